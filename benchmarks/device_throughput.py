"""Offline decode throughput on a torch device (a GPU where one is lent), for models of the registered shapes.

    python benchmarks/device_throughput.py --device cuda --modes default enforce_eager --profile --out graphs.json
    python benchmarks/device_throughput.py --device cpu --shapes tiny --concurrency 1 --tokens 4 --modes default \
        --out /tmp/device.json                                                  # a smoke run, on any machine

Why: on CUDA a decode step launched op by op leaves the GPU idle most of the step; the default replays decode steps
as CUDA graphs, and this is the measurement behind that (docs/performance.md, "CUDA").

A machine lent for a few minutes has none of the shipped GGUF files, and a step's time does not depend on the
weights' values: each model is built here from its shape (SmolLM2-135M, Qwen2.5-Coder-1.5B; `tiny` for a smoke
run) with random weights, as a Hugging Face directory our loader reads, and a tokenizer trained here (prompts are
token ids; `ignore_eos`, so every request runs its whole length). Per concurrency c, c requests (a shared 200-token
prefix and a distinct 56-token tail, the peer workload's shape) generate `--tokens` tokens each together; output
tokens per second of the whole batch, and the mean decode step. Per mode, in one process: the default (on CUDA,
decode steps replayed as CUDA graphs), `enforce_eager` (layer by layer), `compile` (compiled layers). `--profile`
adds the device-busy time and kernel count of a batch-1 step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402
from tests.quantization.tiny_models import trained_tokenizer  # noqa: E402

SHAPES = {  # the registered models' configs (their GGUF metadata), weights random
    "smollm2-135m": dict(kind="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny": dict(kind="llama", vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True),
}


def build(shape: str, folder: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    config_class = Qwen2Config if spec.pop("kind") == "qwen2" else LlamaConfig
    config = config_class(**spec, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 1.5B model's init: seconds there
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    path = folder / shape
    model.save_pretrained(path)
    trained_tokenizer([f"line {i}: some text to learn a few merges from" for i in range(64)]).save_pretrained(path)
    return str(path)


def workload(concurrency: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (200,), generator=gen).tolist()
    return [prefix + torch.randint(3, vocab, (56,), generator=gen).tolist() for _ in range(concurrency)]


def measure(llm: LLM, concurrency: int, vocab: int, tokens: int) -> dict:
    prompts = workload(concurrency, vocab, seed=concurrency)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    # the same shapes once before (other prompts, so the timed ones find nothing cached): compiled graphs, allocator
    llm.generate(workload(concurrency, vocab, seed=1000 + concurrency),
                 SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"concurrency": concurrency, "seconds": round(elapsed, 3), "out_tok_s": round(produced / elapsed, 1),
            "ms_per_step": round(1000 * elapsed / tokens, 2)}


def device_busy(llm: LLM, vocab: int, steps: int = 20) -> dict:
    """One request decoding, under the profiler: wall time of a step against the time the device's kernels ran
    in it (what launching op by op leaves idle)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.add_request("profiled", workload(1, vocab, seed=7)[0],
                       SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps
    launches = sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return {"ms_per_step": round(1000 * wall, 2), "device_busy_ms": round(busy, 2), "kernels_per_step": launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"], choices=list(SHAPES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["default", "enforce_eager"],
                        choices=["default", "enforce_eager", "compile"])
    parser.add_argument("--profile", action="store_true", help="also: device-busy time of a batch-1 step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            path = build(shape, Path(tmp))
            for mode in args.modes:
                start = time.perf_counter()
                llm = LLM(path, device=args.device, max_model_len=1024, kv_cache_memory_gb=4,
                          max_num_seqs=max(args.concurrency), **({} if mode == "default" else {mode: True}))
                loaded = time.perf_counter() - start
                for c in args.concurrency:
                    row = {"shape": shape, "mode": mode, "dtype": str(llm.engine.plan.dtype),
                           "load_s": round(loaded, 1), **measure(llm, c, SHAPES[shape]["vocab_size"], args.tokens)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if args.profile:
                    row = {"shape": shape, "mode": mode, "profiled": True,
                           **device_busy(llm, SHAPES[shape]["vocab_size"])}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del llm
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
