"""`llmserve quantize MODEL --method awq|gptq|int4|int8 --out DIR`: write a quantized checkpoint once, serve it
after.

awq: activation-aware scales searched on the calibration text, then int4 groups; int4: round to nearest on
the same groups; both in AutoAWQ's layout (quantization/export.py). gptq: the same groups rounded column by
column against the calibration text's inputs (quantization/gptq.py), in GPTQ's layout. int8: per output channel,
symmetric (quantization/export_int8.py). fp8: e4m3 per output channel, or in DeepSeek's 128 x 128 blocks
(quantization/export_fp8.py). `llmserve serve DIR` loads the result without quantizing again.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

EXPORT_METHODS = ("awq", "fp8", "gptq", "int4", "int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="registered name, GGUF file or Hugging Face directory (default: the embedded model)")
    parser.add_argument("--method", required=True, help=f"one of {', '.join(EXPORT_METHODS)}")
    parser.add_argument("--out", required=True, help="the directory to write (created; files in it replaced)")
    parser.add_argument("--group-size", type=int, default=128,
                        help="awq, gptq, int4: inputs per scale and zero point, a multiple of 32 (default: "
                        "%(default)s, AutoAWQ's and AutoGPTQ's; llmserve runs 32 and 128 at the same speed, 32 is more "
                        "precise, 128 a smaller file)")
    parser.add_argument("--no-clip", action="store_true", help="awq: skip the weight clipping search")
    parser.add_argument("--duo-scaling", action="store_true",
                        help="awq: AutoAWQ's s = mean|x|^a / mean|w|^(1-a) instead of the paper's mean|x|^a")
    parser.add_argument("--grid", type=int, default=20, help="awq: alpha grid points in [0, 1) (default: %(default)s)")
    parser.add_argument("--calibration", metavar="FILE", default=None,
                        help="awq, gptq: a UTF-8 text file to calibrate on, text like what the model will serve "
                        "(default: llmserve's own, ~1,700 tokens of questions, code and prose; GPTQ fits each weight "
                        "to its calibration inputs and wants more: docs/quantization.md)")
    parser.add_argument("--act-order", action="store_true",
                        help="gptq: round the inputs with the largest activations first (groups fitted before, so "
                        "they stay contiguous: AutoGPTQ's desc_act with static_groups)")
    parser.add_argument("--sym", action="store_true",
                        help="gptq: symmetric groups (zero point 8: AutoGPTQ's default, the only kind vLLM's Marlin "
                        "kernels take) instead of a zero point per group (written as gptq_v2; better here)")
    parser.add_argument("--damp-percent", type=float, default=0.01,
                        help="gptq: the Hessian's dampening, a fraction of its mean diagonal (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="int8, fp8: the dtype the weights are quantized from, the one they will be served in "
                        "(auto: as `serve` picks on this CPU), so the served values are the written ones")
    parser.add_argument("--fp8-block", type=int, default=None, choices=(128,),
                        help="fp8: one scale per block of N x N weights (DeepSeek-V3's layout, quant_method fp8 with "
                        "weight_block_size) instead of one per output channel (compressed-tensors' float-quantized)")


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
    from llmserve.quantization.gptq import GPTQConfig

    # checked before the model loads
    config = (GPTQConfig(group_size=args.group_size, sym=args.sym, act_order=args.act_order,
                         damp_percent=args.damp_percent) if args.method == "gptq" else
              AWQConfig(group_size=args.group_size, grid=args.grid, duo_scaling=args.duo_scaling,
                        clip=not args.no_clip))
    calibration = None
    if args.calibration is not None:
        try:
            with open(args.calibration, encoding="utf-8") as f:
                calibration = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--calibration {args.calibration}: {e}") from e
        if not calibration.strip():
            raise ValueError(f"--calibration {args.calibration} is empty")
    start = time.perf_counter()
    ckpt = load_checkpoint(args.model)
    source = ckpt.name
    if args.method == "int8":
        import torch

        from llmserve.host import cpu_has_native_bf16
        from llmserve.quantization.export_int8 import save_int8_checkpoint

        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
        return str(save_int8_checkpoint(ckpt, args.out, getattr(torch, dtype), {"method": "int8", "source": source}))
    if args.method == "fp8":
        import torch

        from llmserve.host import cpu_has_native_bf16
        from llmserve.quantization.export_fp8 import save_fp8_checkpoint

        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
        provenance = {"method": "fp8", "source": source, "block": args.fp8_block}
        return str(save_fp8_checkpoint(ckpt, args.out, getattr(torch, dtype), args.fp8_block, provenance))
    from llmserve.loader.gptq_format import quantization_config
    from llmserve.quantization.export import save_int4_checkpoint
    from llmserve.quantization.quantize_checkpoint import quantize_checkpoint

    ckpt, result = quantize_checkpoint(ckpt, args.method, config, calibration)
    provenance = {"method": args.method, "source": source, "group_size": config.group_size}
    calibration_name = (os.path.basename(args.calibration) if args.calibration is not None else
                        "llmserve/quantization/calibration.txt")
    gptq = None
    if args.method == "gptq":
        gptq = quantization_config(config.group_size, config.sym, config.act_order, config.damp_percent)
        provenance.update(calibration=calibration_name)
    if result is not None:
        provenance.update(grid=config.grid, duo_scaling=config.duo_scaling, clip=config.clip,
                          calibration=calibration_name,
                          alphas={f"{s.layer}.{s.block}": s.alpha for s in result.searches},
                          scales_kept=result.scaled, clips_kept=result.clipped)
    out = save_int4_checkpoint(ckpt, args.out, provenance, gptq)
    logging.getLogger(__name__).info("%s -> %s (%s, group size %d) in %.1fs", source, out, args.method,
                                     config.group_size, time.perf_counter() - start)
    return str(out)
