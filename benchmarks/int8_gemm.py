"""The int8-activation path's products: our AMX kernel (`llmserve::int8_gemm`) against oneDNN's
(`onednn::qlinear_pointwise`, what `int8_linear` called before), both with the token scales applied and
the result in bf16, as a decode or prompt step needs them.

    .venv/bin/python benchmarks/int8_gemm.py [--tokens 17,32,64,128,256,512] [--repeats 7]

SmolLM2-135M's 120 decoder products (30 layers x qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536),
each with weights of its own, run back to back as in a step: ~106 MB of int8 weight, more than the caches
hold, so each pass streams them from memory. Per token count, the two kernels' passes alternate and the
median is reported (the host is noisy; both see the same noise). Results are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve.kernels import amx_int8_gemm, load_cpu_kernels  # noqa: E402
from llmserve.kernels.int8_gemm import pack_int8_for_amx  # noqa: E402
from llmserve.quantization.int8_activations import pack_int8_weight  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="17,32,64,128,256,512", help="activation rows (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7, help="timed passes per kernel (default: %(default)s)")
    args = ap.parse_args()
    if not (load_cpu_kernels() and amx_int8_gemm()):
        sys.exit("this machine has no AMX build of llmserve's kernels: nothing to compare")
    ops = torch.ops.llmserve
    torch.manual_seed(0)
    print(f"packing {LAYERS * len(SHAPES)} int8 weights ...", flush=True)
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            packed, comp = pack_int8_for_amx(w)
            scales, zeros = torch.rand(n) * 0.01, torch.zeros(n, dtype=torch.long)
            layers.append((k, pack_int8_weight(w), packed, comp, scales, zeros))
    weight_mb = sum(n * k for n, k in SHAPES) * LAYERS / 1e6

    def onednn(xs: dict[int, tuple]) -> list[torch.Tensor]:
        out = []
        for k, onednn_w, _, _, scales, zeros in layers:
            xu, rs = xs[k]
            y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, onednn_w, scales, zeros, None, 1.0, 0,
                                                   torch.float32, "none", [], "")
            out.append((y * rs).to(torch.bfloat16))
        return out

    def ours(xs: dict[int, tuple]) -> list[torch.Tensor]:
        return [ops.int8_gemm(*xs[k], packed, scales, comp, torch.bfloat16) for k, _, packed, comp, scales, _ in layers]

    print("| tokens | oneDNN ms | ours ms | speed-up | ours GB/s of weight |")
    print("|---:|---:|---:|---:|---:|")
    for m in map(int, args.tokens.split(",")):
        xs = {k: ops.quantize_activations_u8(torch.randn(m, k, dtype=torch.bfloat16), torch.ones(k)) for _, k in SHAPES}
        if not all(torch.equal(a, b) for a, b in zip(onednn(xs), ours(xs), strict=True)):
            sys.exit(f"results differ at {m} tokens")
        times: dict[str, list[float]] = {"onednn": [], "ours": []}
        for _ in range(args.repeats):
            for name, fn in (("onednn", onednn), ("ours", ours)):
                t = time.perf_counter()
                fn(xs)
                times[name].append(time.perf_counter() - t)
        a, b = statistics.median(times["onednn"]) * 1e3, statistics.median(times["ours"]) * 1e3
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {weight_mb / b:.1f} |", flush=True)


if __name__ == "__main__":
    main()
