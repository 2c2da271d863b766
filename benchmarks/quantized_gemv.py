"""The products of a decode step on the native quantized kernels, weights streamed from memory as a step reads them.

    .venv/bin/python benchmarks/quantized_gemv.py                                   # native against PyTorch
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --tokens 1,8,32 --parts 2,1
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --int8-layers --tokens 1,8,16,32
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --layouts --tokens 1,8,32 --parts 1
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --six-bit --tokens 1,8,32
    .venv/bin/python benchmarks/quantized_gemv.py --amx-int8 --tokens 17,32,64,128,256,512   # AMX hosts
    .venv/bin/python benchmarks/quantized_gemv.py --layers 1 --tokens 1 --rounds 1           # a smoke run

Why: a one-token decode step reads every weight once, so its products are bound by memory, and the kernel's
layout (bits a weight, the order the loop reads them) and its per-call costs decide the step. Each mode below
is the measurement behind one choice the engine makes; docs/performance.md, "Quantized weight kernels" and
"Large steps", has the figures.

One decode step's worth of weights (SmolLM2: 30 layers x qkv, o, gate_up, down; Qwen2.5-Coder-1.5B's shapes with
`--shapes`), each layer its own weight as in the model. "Streamed" = a 256 MiB read between steps evicts the
weights, as a real step's other work does; that is the figure a server's step pays.

- default: int4 layers and the int8 output head on the native kernels against PyTorch's weight-only kernels,
  hot (the same step repeated) and streamed.
- `--parts 2,1`: the native int4 products with their inputs split into each number of int8 parts (2: ~16 bits,
  1: Q8_0), alternated: what Q8_0 inputs buy.
- `--int8-layers`: the int8 layers a K-quant mix gives a model (Qwen2.5-Coder-1.5B's Q4_K_M: the q/k/v with a
  Q6_K v and the Q6_K ffn_down) on the native int8 kernel against the dense bfloat16 product (oneDNN-packed):
  where the crossover lies.
- `--layouts`: the int4 products on a Q4_K grid in both of the kernel's layouts, fp16 scales (5 bits a weight)
  and super-blocks (4.625), alternated.
- `--six-bit`: the weights a Q4_K_M file stores as Q6_K (the output head, half the ffn_down) on the int8 kernel,
  re-quantized to int8 per row (8 bits a weight) and at the file's 6-bit values (6.625), alternated.
- `--amx-int8`: the int8-activation path's large-step products (SmolLM2's 120 decoder products as int8 x int8):
  our AMX kernel (`llmserve::int8_gemm`) against oneDNN's `qlinear_pointwise`, token scales applied and the
  result in bf16, results checked equal first. Hosts without AMX say so and exit 0.

`--layers` and `--rounds` shrink a run (a smoke run: `--layers 1 --tokens 1 --rounds 1`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve.kernels import amx_int8_gemm, load_cpu_kernels, native_quantized_kernels  # noqa: E402
from llmserve.quantization.weight_only import WeightOnlyLinear  # noqa: E402

# per model: layers, the linears' [out, in] (qkv, o, gate_up, down) and the output head's
SHAPE_SETS = {
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "qwen2.5-coder-1.5b": (28, [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], (151936, 1536)),
}


def timed(step, evict: torch.Tensor | None, repeats: int = 15) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="smollm2")
    ap.add_argument("--tokens", default=None, help="token counts (default: 1,2,4,5,6,8; --amx-int8: "
                    "17,32,64,128,256,512)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternated rounds of the comparing modes (default: 12 for --layouts and --six-bit, 4 for "
                         "--parts and --int8-layers, 7 for --amx-int8)")
    ap.add_argument("--parts", help="compare the int4 kernel's activation parts instead, e.g. 2,1")
    ap.add_argument("--int8-layers", action="store_true",
                    help="the int8 layers of a K-quant mix: native int8 kernel against the dense product")
    ap.add_argument("--layouts", action="store_true",
                    help="int4 on a Q4_K grid: fp16-scale layout against the super-block layout")
    ap.add_argument("--six-bit", action="store_true",
                    help="a Q4_K_M file's Q6_K layers (head, half the ffn_down): int8 per row against 6-bit")
    ap.add_argument("--amx-int8", action="store_true",
                    help="int8 x int8 large-step products: the AMX kernel against oneDNN's")
    args = ap.parse_args()
    model_layers, shapes, head = SHAPE_SETS[args.shapes]
    num_layers = args.layers or model_layers
    torch.manual_seed(0)
    if args.amx_int8:
        return compare_amx_int8(num_layers, [int(t) for t in (args.tokens or "17,32,64,128,256,512").split(",")],
                                args.rounds or 7)
    if not native_quantized_kernels():
        sys.exit("the native quantized kernels are not built vectorized on this machine (AVX-512 VNNI or AVX2)")
    token_counts = [int(t) for t in (args.tokens or "1,2,4,5,6,8").split(",")]
    if args.layouts:
        return compare_layouts(num_layers, shapes, token_counts, int(args.parts or 1), args.rounds or 12)
    if args.six_bit:
        return compare_six_bit(num_layers, shapes, head, token_counts, int(args.parts or 1), args.rounds or 12)
    if args.int8_layers:
        return int8_layers(num_layers, shapes, token_counts, int(args.parts or 1), args.rounds or 4)
    if args.parts:
        return compare_parts(num_layers, shapes, token_counts, [int(p) for p in args.parts.split(",")],
                             args.rounds or 4)
    print("quantizing one step's weights twice (native and PyTorch layouts) ...", flush=True)
    layers = {native: [] for native in (True, False)}
    for _ in range(num_layers):
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02
            for native in (True, False):
                layers[native].append(WeightOnlyLinear(weight, "int4", native_kernels=native))
    head_weight = torch.randn(*head, dtype=torch.bfloat16) * 0.02
    heads = {native: WeightOnlyLinear(head_weight, "int8", native_kernels=native) for native in (True, False)}
    evict = torch.ones(2**26)  # 256 MiB
    int4_bytes = sum(m.qweight.numel() * m.qweight.element_size() for m in layers[True])
    print(f"int4 layers: {int4_bytes / 1e6:.1f} MB (native layout); head: {head[0] * head[1] / 1e6:.1f} MB int8")
    print("| tokens | what | PyTorch hot ms | native hot ms | PyTorch streamed ms | native streamed ms | "
          "streamed speed-up | native streamed GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    widths = {in_features for _, in_features in shapes}
    repeats = 15 if args.rounds is None else max(args.rounds, 1)
    for tokens in token_counts:
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for k in widths}
        for what, nbytes in (("int4 layers", int4_bytes), ("int8 head", head[0] * head[1])):
            def step(native: bool, what=what, xs=xs) -> None:
                if what == "int4 layers":
                    for layer in layers[native]:
                        layer(xs[layer.weight.shape[1]])
                else:
                    heads[native](xs[head[1]])
            hot = {n: timed(lambda n=n: step(n), None, repeats) for n in (False, True)}
            streamed = {n: timed(lambda n=n: step(n), evict, repeats) for n in (False, True)}
            print(f"| {tokens} | {what} | {hot[False]:.2f} | {hot[True]:.2f} | {streamed[False]:.2f} | "
                  f"{streamed[True]:.2f} | {streamed[False] / streamed[True]:.2f}x | "
                  f"{nbytes / streamed[True] / 1e6:.1f} |", flush=True)


def compare_amx_int8(num_layers: int, token_counts: list[int], repeats: int) -> None:
    """SmolLM2's decoder products as int8 x int8 (each layer its own weight: ~106 MB for 30 layers, more than the
    caches hold, so each pass streams them), our AMX kernel against oneDNN's, passes alternated, the median."""
    if not (load_cpu_kernels() and amx_int8_gemm()):
        print("skipped: this machine has no AMX build of llmserve's kernels (nothing to compare)")
        return
    from llmserve.kernels.int8_gemm import pack_int8_for_amx
    from llmserve.quantization.int8_activations import pack_int8_weight

    shapes = SHAPE_SETS["smollm2"][1]
    ops = torch.ops.llmserve
    print(f"packing {num_layers * len(shapes)} int8 weights ...", flush=True)
    layers = []
    for _ in range(num_layers):
        for n, k in shapes:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            packed, comp = pack_int8_for_amx(w)
            scales, zeros = torch.rand(n) * 0.01, torch.zeros(n, dtype=torch.long)
            layers.append((k, pack_int8_weight(w), packed, comp, scales, zeros))
    weight_mb = sum(n * k for n, k in shapes) * num_layers / 1e6

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
    for m in token_counts:
        xs = {k: ops.quantize_activations_u8(torch.randn(m, k, dtype=torch.bfloat16), torch.ones(k)) for _, k in shapes}
        if not all(torch.equal(a, b) for a, b in zip(onednn(xs), ours(xs), strict=True)):
            sys.exit(f"results differ at {m} tokens")
        times: dict[str, list[float]] = {"onednn": [], "ours": []}
        for _ in range(repeats):
            for name, fn in (("onednn", onednn), ("ours", ours)):
                t = time.perf_counter()
                fn(xs)
                times[name].append(time.perf_counter() - t)
        a, b = statistics.median(times["onednn"]) * 1e3, statistics.median(times["ours"]) * 1e3
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {weight_mb / b:.1f} |", flush=True)


def compare_parts(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: list[int],
                  rounds: int) -> None:
    """One step's int4 products (weights streamed) per number of activation parts, alternated `rounds` times: the
    best."""
    print("quantizing one step's int4 weights ...", flush=True)
    layers = [WeightOnlyLinear(torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02, "int4",
                               native_kernels=True)
              for _ in range(num_layers) for out_features, in_features in shapes]
    evict = torch.ones(2**26)  # 256 MiB
    print("| tokens | " + " | ".join(f"{p} part{'s' if p > 1 else ''} ms" for p in parts) + " | ratio |")
    print("|---:|" + "---:|" * (len(parts) + 1))
    for tokens in token_counts:
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for _, k in shapes}
        best = {p: float("inf") for p in parts}
        for _ in range(rounds):
            for p in parts:
                def step(p=p, xs=xs) -> None:
                    for layer in layers:
                        torch.ops.llmserve.int4_gemv(xs[layer.weight.shape[1]], layer.qweight, layer.out_features, p)
                best[p] = min(best[p], timed(step, evict, repeats=3))
        print(f"| {tokens} | " + " | ".join(f"{best[p]:.1f}" for p in parts) +
              f" | {best[parts[0]] / best[parts[-1]]:.2f}x |", flush=True)


def compare_layouts(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: int,
                    rounds: int) -> None:
    """Every linear of the step in int4 on a Q4_K grid, packed in each layout (the same values but the fp16
    rounding of the scales), weights streamed, alternated (which goes first alternating too): the median of each,
    and the range of the per-round ratios."""
    from llmserve.kernels.quantized_gemv import pack_int4

    def q4_k_grid(out_features: int, in_features: int, size: float) -> torch.Tensor:
        d = (torch.rand(out_features, in_features // 256, 1) * size / 63).half().float()
        sc = torch.randint(0, 64, (out_features, in_features // 256, 8))
        sc[..., 0] = 63
        return (d * sc).view(out_features, -1)

    print("packing one step's int4 weights in both layouts ...", flush=True)
    packs: dict[str, list[tuple[torch.Tensor, int, int]]] = {"fp16 scales": [], "super-blocks": []}
    for _ in range(num_layers):
        for out_features, in_features in shapes:
            q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
            scales, mins = q4_k_grid(out_features, in_features, 0.01), -q4_k_grid(out_features, in_features, 0.05)
            packs["super-blocks"].append((pack_int4(q, scales, mins), out_features, in_features))
            packs["fp16 scales"].append((pack_int4(q, scales.half().float(), mins.half().float()), out_features,
                                         in_features))
    alternated({name: [(packed, None, n, k) for packed, n, k in layers] for name, layers in packs.items()},
               token_counts, parts, rounds)


def compare_six_bit(num_layers: int, shapes: list[tuple[int, int]], head: tuple[int, int], token_counts: list[int],
                    parts: int, rounds: int) -> None:
    """The weights a Q4_K_M file stores as Q6_K (the output head, half the ffn_down) on the int8 op in both layouts:
    re-quantized to int8 per row, and the file's 6-bit values (`pack_int6`), weights streamed, alternated."""
    from llmserve.kernels.quantized_gemv import pack_int6, pack_int8
    from llmserve.quantization.methods.int8 import quantize_int8

    print("packing the Q6_K layers in both layouts ...", flush=True)
    packs: dict[str, list] = {"int8 per row": [], "6-bit": []}
    for out_features, in_features in [head, *[shapes[3]] * (num_layers // 2)]:
        q = torch.randint(0, 64, (out_features, in_features))
        d = (torch.rand(out_features, in_features // 256) * 1e-3).half().float()
        sc = torch.randint(-128, 128, (out_features, in_features // 16), dtype=torch.int8)
        w = (d.repeat_interleave(16, dim=1) * sc.float()).repeat_interleave(16, dim=1) * (q - 32).float()
        q8, scales, _ = quantize_int8(w)
        packs["int8 per row"].append((pack_int8(q8), scales.float(), out_features, in_features))
        packs["6-bit"].append((pack_int6(q, d, sc), torch.ones(out_features), out_features, in_features))
        del w, q8
    alternated(packs, token_counts, parts, rounds)


def alternated(packs: dict[str, list[tuple[torch.Tensor, torch.Tensor | None, int, int]]], token_counts: list[int],
               parts: int, rounds: int) -> None:
    """Two sets of packed weights ((packed, int8 row scales or None for int4, out, in) each), one step's products
    on each, weights streamed, alternated `rounds` times (which goes first alternating too): the median of each, and
    the range of the per-round ratios."""
    nbytes = {name: sum(p.numel() for p, _, _, _ in layers) for name, layers in packs.items()}
    print(", ".join(f"{name}: {b / 1e6:.1f} MB" for name, b in nbytes.items()) + f"; inputs in {parts} part(s)")
    evict = torch.ones(2**26)  # 256 MiB
    names = list(packs)
    print("| tokens | " + " | ".join(f"{n} ms | {n} GB/s" for n in names) + " | speed-up, per round |")
    print("|---:|" + "---:|" * (2 * len(names)) + "---|")
    for tokens in token_counts:
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for _, _, _, k in packs[names[0]]}
        ms: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                def step(name=name, xs=xs) -> None:
                    for packed, scales, out_features, in_features in packs[name]:
                        if scales is None:
                            torch.ops.llmserve.int4_gemv(xs[in_features], packed, out_features, parts)
                        else:
                            torch.ops.llmserve.int8_gemv(xs[in_features], packed, scales, out_features, parts)
                ms[name].append(timed(step, evict, repeats=3))
        median = {n: statistics.median(ms[n]) for n in names}
        ratios = [a / b for a, b in zip(ms[names[0]], ms[names[1]], strict=True)]
        print(f"| {tokens} | " + " | ".join(f"{median[n]:.1f} | {nbytes[n] / median[n] / 1e6:.1f}" for n in names)
              + f" | {min(ratios):.2f}-{max(ratios):.2f}x |", flush=True)


def int8_layers(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: int,
                rounds: int) -> None:
    """Half the layers' q/k/v and down projections in int8 (a Q4_K_M file's Q6_K share), native kernel against the
    dense product of the same values, weights streamed, alternated `rounds` times: the best of each."""
    from llmserve.layers.linear import dense_linear, prepack_weight

    print("quantizing the int8 layers ...", flush=True)
    qkv, _, _, down = shapes
    layers = []
    for _ in range(max(num_layers // 2, 1)):
        for out_features, in_features in (qkv, down):
            layer = WeightOnlyLinear(torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02, "int8",
                                     native_kernels=True, activation_parts=parts)
            layer.packed = prepack_weight(layer.weight)
            layers.append(layer)
    nbytes = sum(m.qweight.numel() for m in layers)
    evict = torch.ones(2**26)  # 256 MiB
    print(f"{len(layers)} int8 layers, {nbytes / 1e6:.1f} MB, inputs in {parts} int8 part{'s' * (parts > 1)}")
    print("| tokens | native int8 ms | dense bf16 ms | native GB/s | dense / native |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in token_counts:
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for _, k in (qkv, down)}
        best = {"native": float("inf"), "dense": float("inf")}
        for _ in range(rounds):
            for how in best:
                def step(how=how, xs=xs) -> None:
                    for layer in layers:
                        x = xs[layer.qweight.numel() // layer.out_features]
                        layer._small_step(layer, x) if how == "native" else dense_linear(layer, x)
                best[how] = min(best[how], timed(step, evict, repeats=3))
        print(f"| {tokens} | {best['native']:.1f} | {best['dense']:.1f} | {nbytes / best['native'] / 1e6:.1f} | "
              f"{best['dense'] / best['native']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
