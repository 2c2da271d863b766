"""Where a c=1 step's time goes outside the decoder stack: wrappers on the engine's calls."""
import sys, time, torch, collections
from llmserve import LLM, SamplingParams
torch.set_num_threads(2)
llm = LLM(speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
engine = llm.engine
runner, model = engine.runner, engine.runner.model
acc = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def timed(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t; return r
    setattr(obj, name, timed)
wrap(engine.scheduler, "schedule", "schedule")
wrap(runner, "update_states", "update_states")
wrap(runner, "execute", "execute")
wrap(model, "forward_fused", "  forward_fused")
wrap(model.embed_tokens, "forward", "    embed")
wrap(model.rotary, "lookup", "    rotary")
wrap(model.norm, "forward", "    norm")
wrap(model.lm_head, "forward", "    lm_head")
import llmserve.layers.attention as A
_am = A.attention_metadata
import llmserve.engine.model_runner as MR
def am(*a, **k):
    t = time.perf_counter(); r = _am(*a, **k); acc["  attn_meta"] += time.perf_counter() - t; return r
MR.attention_metadata = am
import llmserve.layers.sampler as SA
_s = MR.sample
def smp(*a, **k):
    t = time.perf_counter(); r = _s(*a, **k); acc["  sample"] += time.perf_counter() - t; return r
MR.sample = smp
wrap(model, "compute_logits", "  compute_logits")
wrap(runner, "_sampling_metadata", "  sampling_metadata")
wrap(engine.scheduler, "update_from_output", "update_from_output")
wrap(engine, "_update_output", "_update_output")
class S:
    def __init__(self, st): self.st = st
    def run(self, *a):
        t = time.perf_counter(); r = self.st.run(*a); acc["    stack.run"] += time.perf_counter() - t; return r
runner.fused_stack = S(runner.fused_stack)
vocab = engine.model_config.vocab_size
prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=3500, ignore_eos=True))
while engine.requests["probe"].num_computed_tokens < len(prompt):
    engine.step()
for _ in range(16):
    engine.step()
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    acc.clear(); n = 200
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    step = (time.perf_counter() - t) / n
    print(f"step {step*1e3:.3f} ms: " + ", ".join(f"{k.strip()} {v/n*1e3:.3f}" for k, v in acc.items()), flush=True)
