"""Weight-only quantized linear layers (int8 per output channel, int4 in groups of 32).

Why: a decode step of a few requests is bound by the bytes of weight it reads, and int4/int8 read
4x/2x fewer than bf16. Small steps run our native kernels (`kernels/quantized_gemv.cpp`, which stream
the weights at close to the machine's memory bandwidth) where they are built, else PyTorch's CPU kernels
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`. Both are slower than a bf16 GEMM once a step
carries more than a handful of tokens (docs/performance.md, "Large steps: int8 activations and dense products").
So each layer keeps both:
the quantized weight for small steps and its exact dequantization, in the model dtype, for large ones.
Both paths compute with the same quantized values; they differ only in rounding order.

int4 follows GGUF's Q4_1 scheme (per group of 32 inputs: w = q * scale + min, q in [0, 15], scale and
minimum fp16 values). A weight the file stored on a 4-bit grid (Q4_0, Q4_1, Q4_K: the loader's
`int4_grids`) keeps that grid, so the int4 path computes with the values shipped (Q4_K's scales and
minimums, products of an fp16 and a 6-bit integer, exactly: the native kernel keeps them as such, in its
super-block layout, 4.625 bits a weight; `pack_int4`); any other weight gets a grid
fitted to it (scale = (max - min) / 15, min = the group's minimum). AWQ's groups (any multiple of 32
inputs, w = (q - z) * s: an AWQ checkpoint's, or `--quantization awq`'s) arrive the same way, as
`int4_grids` (quantization/int4_groups.py).

int8 is symmetric per output channel, except for a weight the file stored on a grid int8 holds
(`Checkpoint.int8_grids`): Q6_K (an int8 scale per 16 inputs, an fp16 factor per 256), which the native int8
kernel reads in a 6-bit layout of its own (`pack_int6`, 6.625 bits a weight, fewer bytes than int8 and exact), or
Q8_0 and Q5_0 (an fp16 d per 32 inputs), which it reads as int8 with each group's d (`pack_int8_grouped`, 8.5 bits
a weight, exact). Those keep the file's values.

A fused weight (q/k/v, gate/up) whose parts the file stored in different formats (Q4_K_M's q and k Q4_K, v Q6_K)
becomes a `StackedLinear`: one layer per run of rows of one format, each computing as above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from llmserve.kernels.int8_gemm import int8_gemm_packs, pack_int8_for_amx
from llmserve.kernels.quantized_gemv import (
    INT6_SUB,
    INT6_SUPER,
    SuperBlocks,
    int4_packs,
    int6_packs,
    int8_packs,
    pack_int4,
    pack_int6,
    pack_int8,
    pack_int8_grouped,
    super_blocks,
)
from llmserve.layers.linear import dense_linear
from llmserve.quantization.int8_activations import int8_linear, pack_int8_weight, quantize_rows, smoothing_scales

INT4_GROUP_SIZE = 32
# Steps with at most this many tokens use the quantized kernel: past them the dense product is faster
# (docs/performance.md, "Quantized weight kernels").
QUANTIZED_MAX_TOKENS = {"int8": 8, "int4": 16, "int4+int8": 16}
# ... and with Q8_0 inputs (one activation part), whose int4 products of 32 tokens cost what 16 do with two, well
# below a step of 32 tokens on the dense bf16 weights; its int8 layers too
# (docs/performance.md, "Quantized weight kernels"; `benchmarks/quantized_gemv.py --int8-layers`).
Q8_MAX_TOKENS = 32
# With the AMX int8 x int8 product, steps from this many tokens take it: from there it costs less than the int4
# kernel, and any count up to 16 is the same tile work
# (docs/performance.md, "Large steps: int8 activations and dense products"; `benchmarks/quantized_gemv.py
# --amx-int8`). Quality: what every step int8 x int8 costs over int4 ("Weight quantization quality") bounds what
# this costs.
AMX_MIN_TOKENS = 9


class WeightOnlyLinear(nn.Module):
    """A linear layer `y = x W^T (+ b)` over a quantized W (a bias, as Qwen2's q/k/v have, stays as it is).

    Two products, chosen once when the layer is built: the small-step kernel (steps of at most
    `max_quantized_tokens` tokens) and the large-step product (the exact dequantized weight, or int8 x int8
    once `use_int8_activations` ran). A call only picks between the two by its token count."""

    def __init__(self, weight: torch.Tensor, method: str, native_kernels: bool = False,
                 max_quantized_tokens: int | None = None, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None, activation_parts: int = 2,
                 int8_grid: tuple[torch.Tensor, ...] | None = None) -> None:
        """`native_kernels`: small steps through `torch.ops.llmserve` (the caller has loaded them), which
        keep a weight copy of their own layout instead of PyTorch's. `grid`: int4's (scale, min) per group,
        the file's own (see the module docstring); int8 has no use for it. `int8_grid`: int8's, a Q6_K weight's
        (d, sc) or a Q8_0 / Q5_0 weight's (d,) (`Checkpoint.int8_grids`): the layer computes with the file's values
        instead of re-quantizing them per row, the native kernel in its 6-bit or grouped layout; ignored where it
        does not give this weight's values (a weight changed since it was read). `activation_parts`: how the native
        int4 kernel takes a small step's inputs, 2 int8 parts (~16 bits) or 1 (Q8_0: an int8 per input, a
        scale per 32, half the integer work; the build plan chooses, see `Q8_MAX_TOKENS`). The native int8
        kernel takes its inputs the same way."""
        super().__init__()
        if method not in ("int8", "int4"):
            raise ValueError(f"a layer's quantization is 'int8' or 'int4', got {method!r}")
        if activation_parts not in (1, 2):
            raise ValueError(f"activation_parts is 1 or 2, got {activation_parts}")
        self.method = method
        self.activation_parts = activation_parts
        self.max_quantized_tokens = max_quantized_tokens or QUANTIZED_MAX_TOKENS[method]
        dtype = weight.dtype
        out_features, in_features = weight.shape
        packs = int4_packs if method == "int4" else int8_packs
        self.native = native_kernels and packs(out_features, in_features)
        with torch.no_grad():
            levels = _int8_file_levels(weight, int8_grid, native_kernels) if method == "int8" else None
            self.six_bit = isinstance(levels, Int6Levels)  # the file's Q6_K values, not re-quantized per row
            self.grouped = isinstance(levels, GroupedLevels)  # the file's Q8_0 or Q5_0 values, likewise
            if levels is not None:  # native: the 6-bit or grouped layout, row scales ones
                dequantized = levels.dequantized
                kernel_weights = (levels.pack(), torch.ones(out_features)) if self.native else (None, None)
            elif method == "int8":
                q, scales, dequantized = _quantize_int8(weight)
                kernel_weights = (pack_int8(q), scales.float()) if self.native else (q, scales.to(dtype))
            else:
                q, scales, mins, dequantized, blocks = _quantize_int4(weight, grid, self.native)
                kernel_weights = (
                    (pack_int4(q, scales, mins, blocks), None) if self.native
                    else _torch_int4_pack(q, scales, mins, dtype)
                )
        # the small-step kernel's weight and scales: the native layout, or PyTorch's
        self.register_buffer("qweight", kernel_weights[0])
        self.register_buffer("scales", kernel_weights[1])
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # (none for the file's int8 grids without the native kernels: PyTorch's int8 kernel would need them
        # re-quantized, so every step takes the dense product of the same values)
        self._small_step = None if kernel_weights[0] is None else _SMALL_STEP_KERNELS[method, self.native]
        # the large-step path: the quantized values themselves, in the model dtype
        self.register_buffer("weight", dequantized.to(dtype))
        self.packed: torch.Tensor | None = None  # its oneDNN-packed copy, once `prepack_linears` made one
        self._large_step = dense_linear
        # or, once `use_int8_activations` ran, the large-step path is int8 x int8 (see int8_activations.py)
        self.register_buffer("int8_weight", None)
        self.register_buffer("int8_scales", None)
        self.register_buffer("int8_zeros", None)
        self.register_buffer("smooth_inv", None)
        self.int8_packed: torch.Tensor | None = None
        self.register_buffer("int8_amx_packed", None)  # or the weight in our AMX kernel's layout
        self.register_buffer("int8_compensation", None)

    def use_int8_activations(self, act_absmax: torch.Tensor, amx: bool = False) -> None:
        """Large steps from now on: SmoothQuant-smoothed int8 weights x per-token int8 activations, given
        the largest |input| seen per channel. The dense weight and its packed copy are released.
        `amx`: the product runs on our AMX kernel (`kernels/int8_gemm.cpp`, loaded by the caller) where
        the shape packs."""
        with torch.no_grad():
            smooth = smoothing_scales(act_absmax, self.weight)
            qweight, scales, _ = _quantize_int8(self.weight.float() * smooth)
        self.int8_scales, self.smooth_inv = scales.float(), 1 / smooth
        self.int8_zeros = torch.zeros(len(scales), dtype=torch.int64)
        if amx and int8_gemm_packs(*qweight.shape):
            self.int8_amx_packed, self.int8_compensation = pack_int8_for_amx(qweight)
        else:
            self.int8_weight, self.int8_packed = qweight, pack_int8_weight(qweight)
        self.weight, self.packed = None, None
        self._large_step = WeightOnlyLinear.int8_forward

    @property
    def uses_int8_activations(self) -> bool:
        return self.int8_scales is not None

    @property
    def large_step_kernel(self) -> str:
        """The large-step product: "dense" (the dequantized weight), or int8 x int8 on "onednn" or "amx"."""
        if not self.uses_int8_activations:
            return "dense"
        return "amx" if self.int8_amx_packed is not None else "onednn"

    def int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The large-step product once `use_int8_activations` ran, whatever the number of tokens."""
        amx = (self.int8_amx_packed, self.int8_compensation) if self.large_step_kernel == "amx" else None
        y = int8_linear(x, self.smooth_inv, self.int8_weight, self.int8_scales, self.int8_zeros,
                        self.int8_packed, native_quantize=self.native or amx is not None, amx=amx)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_quantized_tokens and self._small_step is not None:
            y = self._small_step(self, x)
        else:
            return self._large_step(self, x)  # the dense product adds the bias itself
        return y if self.bias is None else y + self.bias


def _native_int4(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.llmserve.int4_gemv(x, layer.qweight, layer.out_features, layer.activation_parts)


def _native_int8(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.llmserve.int8_gemv(x, layer.qweight, layer.scales, layer.out_features, layer.activation_parts)


def _torch_int4(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP_SIZE, layer.scales)


def _torch_int8(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, layer.qweight, layer.scales)


# (method, native) -> the small-step product
_SMALL_STEP_KERNELS = {("int4", True): _native_int4, ("int8", True): _native_int8,
                       ("int4", False): _torch_int4, ("int8", False): _torch_int8}


def _quantize_int8(w: torch.Tensor, rows_at_a_time: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: w ~ q * scale, q in [-127, 127], computed in float32, the values q * scale given
    in w's dtype. A few thousand rows at a time: a whole output head's float32 temporaries (Qwen2.5-Coder-0.5B's
    151,936 x 896) would cost its start fresh pages and passes over memory."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0])
    dequantized = torch.empty_like(w, memory_format=torch.contiguous_format)
    for start in range(0, w.shape[0], rows_at_a_time):
        rows = slice(start, start + rows_at_a_time)
        q[rows], scale = quantize_rows(w[rows].float())
        scales[rows] = scale.squeeze(1)
        dequantized[rows] = q[rows].float() * scale
    return q, scales, dequantized


class Int6Levels(NamedTuple):
    q: torch.Tensor  # [out, in] uint8 in [0, 63]
    d: torch.Tensor  # [out, in / 256] float32
    sc: torch.Tensor  # [out, in / 16] int8
    dequantized: torch.Tensor  # [out, in]: d * sc * (q - 32) in float32, as the file's reader computes it (the
    # native op: the weight itself, which it checked equals them)

    def pack(self) -> torch.Tensor:
        return pack_int6(self.q, self.d, self.sc)


class GroupedLevels(NamedTuple):
    q: torch.Tensor  # [out, in] uint8: the integers in [-128, 127] plus 128
    d: torch.Tensor  # [out, in / 32] float32 (fp16 values)
    dequantized: torch.Tensor  # [out, in]: d * (q - 128) in float32 (the native op: the weight itself, as Int6Levels')

    def pack(self) -> torch.Tensor:
        return pack_int8_grouped(self.q, self.d)


def _int8_file_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None,
                      native: bool = False) -> Int6Levels | GroupedLevels | None:
    """The weight's levels on the file's int8 grid (`Checkpoint.int8_grids`: Q6_K's two tensors or Q8_0's and
    Q5_0's one), or None where there is none or it does not give this weight."""
    if grid is None:
        return None
    return _int6_levels(weight, grid, native) if len(grid) == 2 else _grouped_levels(weight, grid, native)


def _grouped_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, ...], native: bool = False
                    ) -> GroupedLevels | None:
    """The weight's integers on the file's d per 32 inputs, or None where that grid does not give this weight (in
    its own dtype: bf16's rounding moves w / d by at most 128 / 256, which leaves a Q8_0 level of at most 127, and
    any Q5_0 one, the nearest integer)."""
    out_features, in_features = weight.shape
    (d,) = grid
    if not int8_packs(out_features, in_features) or d.shape != (out_features, in_features // INT4_GROUP_SIZE):
        return None
    levels = _levels_on(weight, d.float(), -128, 127, native)
    return None if levels is None else GroupedLevels(levels[0], d.float(), levels[1])


def _levels_on(weight: torch.Tensor, scale: torch.Tensor, lowest: int, highest: int, native: bool
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The integers q in [lowest, highest] with weight = q * scale (`scale` [out, runs], one per run of in / runs
    inputs), as uint8 q - lowest, and those values; None where they do not give the weight. `native`: the kernels
    are loaded, and `grid_levels.cpp`'s `signed_levels` finds the integers and checks them in one pass (the values
    are then the weight's own), else PyTorch's ops (the values in float32): the same integers and values."""
    out_features, in_features = weight.shape
    w = weight.detach()
    if _native_levels(weight, native):
        dense = w.contiguous()
        q, exact = torch.ops.llmserve.signed_levels(dense, scale.contiguous(), lowest, highest)
        if not exact:
            return None
        # the layer keeps these values: not as a view into a larger tensor (a run of a fused weight's rows), which
        # would keep all of it alive
        return q, dense if dense.untyped_storage().nbytes() == dense.nbytes else dense.clone()
    scale = scale.unsqueeze(2)
    # in place after the first op (each fresh [out, in] tensor pays its page faults: start-up time)
    q = torch.div(w.view(out_features, scale.shape[1], -1), torch.where(scale != 0, scale, 1)).round_()
    q = q.clamp_(lowest, highest)
    dequantized = torch.mul(q, scale).view(out_features, in_features)
    if not torch.equal(dequantized.to(weight.dtype), w):  # float32: `to` is no copy
        return None
    return q.sub_(lowest).to(torch.uint8).view(out_features, in_features), dequantized


def _int6_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor] | None,
                 native: bool = False) -> Int6Levels | None:
    """The weight's Q6_K levels on the file's grid (d, sc), or None where that grid does not give this weight (in
    its own dtype: bf16's rounding moves w / (d * sc) by at most 32 / 256, so q is still the nearest integer)."""
    out_features, in_features = weight.shape
    if grid is None or not int6_packs(out_features, in_features):
        return None
    d, sc = grid
    if d.shape != (out_features, in_features // INT6_SUPER) or sc.shape != (out_features, in_features // INT6_SUB):
        return None
    scale = d.float().repeat_interleave(INT6_SUPER // INT6_SUB, dim=1) * sc.float()  # [out, in / 16]
    levels = _levels_on(weight, scale, -32, 31, native)
    return None if levels is None else Int6Levels(levels[0], d.float(), sc.to(torch.int8), levels[1])


def _native_levels(weight: torch.Tensor, native: bool) -> bool:
    """Whether `grid_levels.cpp`'s ops take this weight (else PyTorch's ops compute the same values)."""
    return native and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


class Int4Levels(NamedTuple):
    q: torch.Tensor  # [out, in] integers in [0, 15]: int32 (PyTorch's ops) or uint8 (the native op)
    scale: torch.Tensor  # [out, in / 32] float32, as the kernel holds them
    lo: torch.Tensor
    dequantized: torch.Tensor  # [out, in], float32 (PyTorch's ops) or the weight's dtype (the native op)
    blocks: SuperBlocks | None  # scale and lo as super-block factors (`super_blocks`), or None: fp16 values


def _quantize_int4(w: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor] | None = None,
                   native: bool = False) -> Int4Levels:
    """Asymmetric per group of 32 inputs (Q4_1): w ~ q * scale + min, q in [0, 15], scale and min fp16
    values, or exact where they factor into super-blocks (Q4_K's); `grid` (scale, min) [out, in / 32] when the
    file has one, else fitted to each group. `native`: the kernels are loaded; their `int4_levels` computes
    the same levels and values in one pass over w, in w's dtype."""
    out_features, in_features = w.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    w = w.detach()
    native = _native_levels(w, native)
    groups = w.view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    if grid is None:  # fitted: the group's range in 15 steps, as fp16 values (a minimum is exact in any dtype)
        lo, hi = groups.amin(dim=-1).float(), groups.amax(dim=-1).float()
        exact_scale, exact_lo = ((hi - lo) / 15).clamp(min=1e-7).half().float(), lo.half().float()
    else:  # the file's own: its levels are exact whatever the rounding of w since (a zero scale: one level)
        exact_scale, exact_lo = (g.float().contiguous() for g in grid)
    blocks = super_blocks(exact_scale, exact_lo)
    if blocks is None:
        scale, lo = exact_scale.half().float(), exact_lo.half().float()
    else:  # the kernel's super-block layout holds them exactly (Q4_K's)
        scale, lo = exact_scale, exact_lo
    if native:
        q, dequantized = torch.ops.llmserve.int4_levels(w.contiguous(), exact_scale, exact_lo, scale, lo)
        return Int4Levels(q, scale, lo, dequantized, blocks)
    step = torch.where(exact_scale > 0, exact_scale, torch.ones_like(exact_scale))
    # in place after the first op (each fresh [out, in] tensor pays its page faults: start-up time)
    q = torch.sub(groups.float(), exact_lo[..., None]).div_(step[..., None]).round_().clamp_(0, 15)
    dequantized = torch.mul(q, scale[..., None]).add_(lo[..., None]).view(out_features, in_features)
    return Int4Levels(q.to(torch.int32).view(out_features, in_features), scale, lo, dequantized, blocks)


def _torch_int4_pack(
    q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's int4 layout: the kernel's form is (q - 8) * scale + zero, so zero = min + 8 * scale;
    scales and zeros are packed as [in / 32, out, 2]."""
    scales_and_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros


def layer_method_of(method: str, grid: tuple[torch.Tensor, torch.Tensor] | None) -> str:
    """One layer's method under a model's: "int4+int8" is int4 where the file gave a 4-bit grid, else int8."""
    if method != "int4+int8":
        return method
    return "int4" if grid is not None else "int8"


def quantize_model(model: nn.Module, method: str, native_kernels: bool = False,
                   max_quantized_tokens: int | None = None,
                   grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None, head: str = "int8",
                   activation_parts: int = 2,
                   int8_grids: dict[str, tuple[torch.Tensor, ...]] | None = None) -> nn.Module:
    """Replace every `nn.Linear` of the decoder layers by a `WeightOnlyLinear` (its bias, if any, kept), and
    give the output head `head` weights, int8 unless asked (its logits rank every token; a speculative draft
    takes int4), a tied embedding staying as it is (a lookup reads one row).
    `method`: "int8", "int4", or "int4+int8" (int4 where the file stored the weight on a 4-bit grid,
    int8 where it stored more bits). `native_kernels`: the caller has loaded `llmserve.kernels`; small steps
    use them. `max_quantized_tokens`: the largest step the small-step kernels take (default and ceiling:
    the layer's method's, Q8_MAX_TOKENS for int4 on Q8_0 inputs). `grids`: the checkpoint's `int4_grids`
    (Hugging Face names). `activation_parts`: the int4 layers' small-step inputs (see `WeightOnlyLinear`).
    `int8_grids`: the checkpoint's, which int8 layers (and an int8 head of Q6_K: `head_int8_grid`) keep."""
    grids = {k.removeprefix("model."): v for k, v in (grids or {}).items()}
    int8_grids = {k.removeprefix("model."): v for k, v in (int8_grids or {}).items()}

    def quantized(weight: torch.Tensor, bias: torch.Tensor | None, sources: list[str]) -> WeightOnlyLinear:
        grid = _fused_grid(grids, sources)
        layer_method = layer_method_of(method, grid)
        return WeightOnlyLinear(weight, layer_method, native_kernels,
                                small_step_cap(layer_method, max_quantized_tokens, activation_parts),
                                bias, grid, activation_parts, _fused_grid(int8_grids, sources))

    for prefix, module in list(model.layers.named_modules(prefix="layers")):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                sources = model.checkpoint_sources(f"{prefix}.{child_name}.weight")
                runs = _format_runs(sources, module.source_rows(child_name),
                                    lambda s: _source_format(method, s, grids, int8_grids))
                if len(runs) == 1:
                    setattr(module, child_name, quantized(child.weight, child.bias, sources))
                else:  # rows the file stored in different formats: each run of rows in its own
                    setattr(module, child_name, StackedLinear([
                        quantized(child.weight[rows], None if child.bias is None else child.bias[rows], run)
                        for run, rows in runs]))
    head_source = "embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    model.lm_head = WeightOnlyLinear(model.lm_head.weight, head, native_kernels,
                                     small_step_cap(head, max_quantized_tokens, activation_parts),
                                     activation_parts=activation_parts,
                                     int8_grid=head_int8_grid(int8_grids, head_source))
    return model


def head_int8_grid(int8_grids: dict[str, tuple[torch.Tensor, ...]], source: str) -> tuple[torch.Tensor, ...] | None:
    """The grid an int8 output head keeps: a Q6_K head's own (6.625 bits a weight, exact). A Q8_0 or Q5_0 head is
    re-quantized per row: 8 bits a weight against the grouped layout's 8.5, on the step's largest product (SmolLM2's
    tied Q8_0 embedding is a third of its step's bytes)."""
    grid = int8_grids.get(source)
    return grid if grid is not None and len(grid) == 2 else None


def _source_format(method: str, source: str, grids: dict, int8_grids: dict) -> tuple[str, int]:
    """How a checkpoint tensor is computed under `method`: its layer method, and the file's own grid it keeps, by
    its tensors' count (int4: Q4_K's super-blocks or a fitted fp16 one; int8: Q6_K's 6 bits (2), Q8_0's or Q5_0's
    d per 32 (1), or per row (0))."""
    layer_method = layer_method_of(method, grids.get(source))
    grid = (grids if layer_method == "int4" else int8_grids).get(source)
    return layer_method, 0 if grid is None else len(grid)


def _format_runs(sources: list[str], rows: list[int], format_of: Callable[[str], tuple[str, int]]
                 ) -> list[tuple[list[str], slice]]:
    """A fused weight's sources (their row counts `rows`) grouped into runs of one format: (sources, their rows)."""
    runs: list[tuple[list[str], slice]] = []
    start, previous = 0, None
    for source, count in zip(sources, rows, strict=True):
        form = format_of(source)
        if runs and form == previous:
            runs[-1] = (runs[-1][0] + [source], slice(runs[-1][1].start, start + count))
        else:
            runs.append(([source], slice(start, start + count)))
        start, previous = start + count, form
    return runs


class StackedLinear(nn.Module):
    """A fused linear whose rows the file stored in different formats (Qwen2.5-Coder-1.5B's Q4_K_M q/k/v: q and k
    Q4_K, v Q6_K), as one `WeightOnlyLinear` per run of rows, each in its own format: one format for the whole
    would re-quantize all of them (8 bits a weight instead of 4.625 and 6.625, and not the file's values). The
    output is the parts' side by side; the one-call decode stack calls the parts in turn as well."""

    def __init__(self, parts: list[WeightOnlyLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.native = all(p.native for p in parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases side by side (each part adds its own), or None."""
        biases = [p.bias for p in self.parts]
        return None if biases[0] is None else torch.cat(biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _fused_grid(grids: dict[str, tuple[torch.Tensor, ...]], sources: list[str]) -> tuple[torch.Tensor, ...] | None:
    """A fused weight's grid: its sources' in row order, where every one has one of the same kind."""
    found = [grids.get(s) for s in sources]
    if None in found or len({len(g) for g in found}) > 1:
        return None
    return tuple(torch.cat(parts) for parts in zip(*found, strict=True))


def small_step_cap(method: str, asked: int | None, activation_parts: int) -> int:
    """The largest step a layer's small-step kernel takes: `asked`, at most its method's crossover (Q8_0 inputs'
    for either native kernel, whose integer work they halve). The build plan bounds the one-call decode stack by
    it too."""
    ceiling = Q8_MAX_TOKENS if activation_parts == 1 else QUANTIZED_MAX_TOKENS[method]
    return min(asked or ceiling, ceiling)
