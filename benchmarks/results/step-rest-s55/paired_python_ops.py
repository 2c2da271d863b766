"""In one process, stretches alternated: the step as built (A), and with the Python ops the stack now does added back (B)."""
import statistics, time, torch
from llmserve import LLM, SamplingParams
torch.set_num_threads(2)
llm = LLM(speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
engine = llm.engine
model = engine.runner.model
plain = model.forward_fused
def with_python_ops(stack, input_ids, positions, meta):
    x = model.embed_tokens(input_ids)
    model.rotary.lookup(positions, x.dtype)
    out = plain(stack, input_ids, positions, meta)
    return model.norm(out)
vocab = engine.model_config.vocab_size
prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=3800, ignore_eos=True))
while engine.requests["probe"].num_computed_tokens < len(prompt):
    engine.step()
for _ in range(16):
    engine.step()
diffs = []; a_s = []; b_s = []
for r in range(38):
    times = {}
    for variant in ("A", "B") if r % 2 == 0 else ("B", "A"):
        model.forward_fused = plain if variant == "A" else with_python_ops
        t = time.perf_counter()
        for _ in range(48):
            engine.step()
        times[variant] = (time.perf_counter() - t) / 48 * 1e3
    diffs.append(times["B"] - times["A"]); a_s.append(times["A"]); b_s.append(times["B"])
print(f"A {statistics.median(a_s):.3f} ms, B {statistics.median(b_s):.3f} ms, B-A median {statistics.median(diffs)*1e3:.0f} us, "
      f"mean {statistics.mean(diffs)*1e3:.0f} us, quartiles {[round(q*1e3) for q in statistics.quantiles(diffs, n=4)]}")
