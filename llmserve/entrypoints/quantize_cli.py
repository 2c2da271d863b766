"""`llmserve quantize MODEL --method awq|int4|int8 --out DIR`: write a quantized checkpoint once, serve it after.

awq: activation-aware scales searched on the calibration text, then int4 groups; int4: round to nearest on
the same groups; both in AutoAWQ's layout (quantization/export.py). int8: per output channel, symmetric
(quantization/export_int8.py). `llmserve serve DIR` loads the result without quantizing again.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

EXPORT_METHODS = ("awq", "int4", "int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="registered name, GGUF file or Hugging Face directory (default: the embedded model)")
    parser.add_argument("--method", required=True, help=f"one of {', '.join(EXPORT_METHODS)}")
    parser.add_argument("--out", required=True, help="the directory to write (created; files in it replaced)")
    parser.add_argument("--group-size", type=int, default=128,
                        help="awq, int4: inputs per scale and zero point, a multiple of 32 (default: %(default)s, "
                        "AutoAWQ's; llmserve runs 32 and 128 at the same speed, 32 is more precise, 128 a smaller "
                        "file)")
    parser.add_argument("--no-clip", action="store_true", help="awq: skip the weight clipping search")
    parser.add_argument("--duo-scaling", action="store_true",
                        help="awq: AutoAWQ's s = mean|x|^a / mean|w|^(1-a) instead of the paper's mean|x|^a")
    parser.add_argument("--grid", type=int, default=20, help="awq: alpha grid points in [0, 1) (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="int8: the dtype the weights are quantized from, the one they will be served in "
                        "(auto: as `serve` picks on this CPU), so the served values are the written ones")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.method not in EXPORT_METHODS:
        print(f"error: --method must be one of {list(EXPORT_METHODS)}, got {args.method!r}", file=sys.stderr)
        return 2
    try:
        out = quantize(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def quantize(args: argparse.Namespace) -> str:
    from llmserve.loader import load_checkpoint
    from llmserve.quantization.awq import AWQConfig

    config = AWQConfig(group_size=args.group_size, grid=args.grid, duo_scaling=args.duo_scaling,
                       clip=not args.no_clip)  # checked before the model loads
    start = time.perf_counter()
    ckpt = load_checkpoint(args.model)
    source = ckpt.name
    if args.method == "int8":
        import torch

        from llmserve.host import cpu_has_native_bf16
        from llmserve.quantization.export_int8 import save_int8_checkpoint

        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
        return str(save_int8_checkpoint(ckpt, args.out, getattr(torch, dtype), {"method": "int8", "source": source}))
    from llmserve.quantization.export import save_awq_checkpoint
    from llmserve.quantization.quantize_checkpoint import quantize_checkpoint

    ckpt, result = quantize_checkpoint(ckpt, args.method, config)
    provenance = {"method": args.method, "source": source, "group_size": config.group_size}
    if result is not None:
        provenance.update(grid=config.grid, duo_scaling=config.duo_scaling, clip=config.clip,
                          calibration="llmserve/quantization/calibration.txt",
                          alphas={f"{s.layer}.{s.block}": s.alpha for s in result.searches},
                          scales_kept=result.scaled, clips_kept=result.clipped)
    out = save_awq_checkpoint(ckpt, args.out, provenance)
    logging.getLogger(__name__).info("%s -> %s (%s, group size %d) in %.1fs", source, out, args.method,
                                     config.group_size, time.perf_counter() - start)
    return str(out)
