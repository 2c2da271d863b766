"""The native quantized products against PyTorch's weight-only kernels, on SmolLM2's shapes (or another model's).

    .venv/bin/python benchmarks/quantized_gemv.py
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --tokens 1,5,8
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --tokens 1,8,32 --parts 2,1

One decode step's worth of weights (SmolLM2: 30 layers x qkv, o, gate_up, down in int4; the 49152 x 576
output head in int8), each layer its own weight as in the model, timed per token count in two states: "hot"
(the same step repeated, weights partly in cache) and "streamed" (a 256 MiB read between steps evicts
them, as a real step's other work does). The streamed figure is what a server's step pays.
`--parts 2,1`: instead, the native int4 products alone with their inputs split into each number of int8 parts
(2: ~16 bits; 1: Q8_0), alternated per token count.
`--int8-layers`: instead, the int8 layers a K-quant mix gives a model (Qwen2.5-Coder-1.5B's Q4_K_M: 14 q/k/v with
a Q6_K v, 14 Q6_K ffn_down), each on the native int8 kernel and on the dense bfloat16 product it takes past
`QUANTIZED_MAX_TOKENS["int8"]` (oneDNN-packed, as the engine's), weights streamed, alternated: where the
crossover lies (`--parts 1`, the default there, or 2: the int8 kernel's inputs).
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --int8-layers --tokens 1,8,16,32
`--layouts`: instead, the int4 products on a Q4_K grid (d * sc, -dmin * m per 256 inputs, 6-bit sc and m) in both
of the kernel's layouts, fp16 scales (5 bits a weight) and super-blocks (4.625), weights streamed, alternated.
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --layouts --tokens 1,8,32 --parts 1
`--six-bit`: instead, the weights a Q4_K_M file stores as Q6_K (the output head and half the ffn_down) on the int8
kernel in both its layouts, re-quantized to int8 per row (8 bits a weight) and the file's 6-bit values (6.625),
weights streamed, alternated.
    .venv/bin/python benchmarks/quantized_gemv.py --shapes qwen2.5-coder-1.5b --six-bit --tokens 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve.kernels import native_quantized_kernels  # noqa: E402
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
    ap.add_argument("--tokens", default="1,2,4,5,6,8", help="token counts (default: %(default)s)")
    ap.add_argument("--parts", help="compare the int4 kernel's activation parts instead, e.g. 2,1")
    ap.add_argument("--int8-layers", action="store_true",
                    help="the int8 layers of a K-quant mix: native int8 kernel against the dense product")
    ap.add_argument("--layouts", action="store_true",
                    help="int4 on a Q4_K grid: fp16-scale layout against the super-block layout")
    ap.add_argument("--six-bit", action="store_true",
                    help="a Q4_K_M file's Q6_K layers (head, half the ffn_down): int8 per row against 6-bit")
    args = ap.parse_args()
    num_layers, shapes, head = SHAPE_SETS[args.shapes]
    if not native_quantized_kernels():
        sys.exit("the native quantized kernels are not built vectorized on this machine (AVX-512 VNNI)")
    torch.manual_seed(0)
    if args.layouts:
        return compare_layouts(num_layers, shapes, [int(t) for t in args.tokens.split(",")], int(args.parts or 1))
    if args.six_bit:
        return compare_six_bit(num_layers, shapes, head, [int(t) for t in args.tokens.split(",")], int(args.parts or 1))
    if args.int8_layers:
        return int8_layers(num_layers, shapes, [int(t) for t in args.tokens.split(",")], int(args.parts or 1))
    if args.parts:
        return compare_parts(num_layers, shapes, [int(t) for t in args.tokens.split(",")],
                             [int(p) for p in args.parts.split(",")])
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
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for k in widths}
        for what, nbytes in (("int4 layers", int4_bytes), ("int8 head", head[0] * head[1])):
            def step(native: bool, what=what, xs=xs) -> None:
                if what == "int4 layers":
                    for layer in layers[native]:
                        layer(xs[layer.weight.shape[1]])
                else:
                    heads[native](xs[head[1]])
            hot = {n: timed(lambda n=n: step(n), None) for n in (False, True)}
            streamed = {n: timed(lambda n=n: step(n), evict) for n in (False, True)}
            print(f"| {tokens} | {what} | {hot[False]:.2f} | {hot[True]:.2f} | {streamed[False]:.2f} | "
                  f"{streamed[True]:.2f} | {streamed[False] / streamed[True]:.2f}x | "
                  f"{nbytes / streamed[True] / 1e6:.1f} |", flush=True)


def compare_parts(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: list[int]) -> None:
    """One step's int4 products (weights streamed) per number of activation parts, alternated 4 times: the best."""
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
        for _ in range(4):
            for p in parts:
                def step(p=p, xs=xs) -> None:
                    for layer in layers:
                        torch.ops.llmserve.int4_gemv(xs[layer.weight.shape[1]], layer.qweight, layer.out_features, p)
                best[p] = min(best[p], timed(step, evict, repeats=3))
        print(f"| {tokens} | " + " | ".join(f"{best[p]:.1f}" for p in parts) +
              f" | {best[parts[0]] / best[parts[-1]]:.2f}x |", flush=True)


def compare_layouts(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: int) -> None:
    """Every linear of the step in int4 on a Q4_K grid, packed in each layout (the same values but the fp16
    rounding of the scales), weights streamed, alternated 12 times (which goes first alternating too): the median
    of each, and the range of the per-round ratios."""
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
               token_counts, parts)


def compare_six_bit(num_layers: int, shapes: list[tuple[int, int]], head: tuple[int, int], token_counts: list[int],
                    parts: int) -> None:
    """The weights a Q4_K_M file stores as Q6_K (the output head, half the ffn_down) on the int8 op in both layouts:
    re-quantized to int8 per row, and the file's 6-bit values (`pack_int6`), weights streamed, alternated 12 times."""
    from llmserve.kernels.quantized_gemv import pack_int6, pack_int8
    from llmserve.quantization.weight_only import _quantize_int8

    print("packing the Q6_K layers in both layouts ...", flush=True)
    packs: dict[str, list] = {"int8 per row": [], "6-bit": []}
    for out_features, in_features in [head, *[shapes[3]] * (num_layers // 2)]:
        q = torch.randint(0, 64, (out_features, in_features))
        d = (torch.rand(out_features, in_features // 256) * 1e-3).half().float()
        sc = torch.randint(-128, 128, (out_features, in_features // 16), dtype=torch.int8)
        w = (d.repeat_interleave(16, dim=1) * sc.float()).repeat_interleave(16, dim=1) * (q - 32).float()
        q8, scales, _ = _quantize_int8(w)
        packs["int8 per row"].append((pack_int8(q8), scales.float(), out_features, in_features))
        packs["6-bit"].append((pack_int6(q, d, sc), torch.ones(out_features), out_features, in_features))
        del w, q8
    alternated(packs, token_counts, parts)


def alternated(packs: dict[str, list[tuple[torch.Tensor, torch.Tensor | None, int, int]]], token_counts: list[int],
               parts: int) -> None:
    """Two sets of packed weights ((packed, int8 row scales or None for int4, out, in) each), one step's products
    on each, weights streamed, alternated 12 times (which goes first alternating too): the median of each, and the
    range of the per-round ratios."""
    nbytes = {name: sum(p.numel() for p, _, _, _ in layers) for name, layers in packs.items()}
    print(", ".join(f"{name}: {b / 1e6:.1f} MB" for name, b in nbytes.items()) + f"; inputs in {parts} part(s)")
    evict = torch.ones(2**26)  # 256 MiB
    names = list(packs)
    print("| tokens | " + " | ".join(f"{n} ms | {n} GB/s" for n in names) + " | speed-up, per round |")
    print("|---:|" + "---:|" * (2 * len(names)) + "---|")
    for tokens in token_counts:
        xs = {k: torch.randn(tokens, k, dtype=torch.bfloat16) for _, _, _, k in packs[names[0]]}
        ms: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(12):
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


def int8_layers(num_layers: int, shapes: list[tuple[int, int]], token_counts: list[int], parts: int) -> None:
    """Half the layers' q/k/v and down projections in int8 (a Q4_K_M file's Q6_K share), native kernel against the
    dense product of the same values, weights streamed, alternated 4 times: the best of each."""
    from llmserve.layers.linear import dense_linear, prepack_weight

    print("quantizing the int8 layers ...", flush=True)
    qkv, _, _, down = shapes
    layers = []
    for _ in range(num_layers // 2):
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
        for _ in range(4):
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
