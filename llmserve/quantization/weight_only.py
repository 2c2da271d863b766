"""Weight-only quantized linear layers: one layer for every registered weight format (quantization/methods/).

Why: a decode step of a few requests is bound by the bytes of weight it reads, and int4/int8 read
4x/2x fewer than bf16. Small steps run the format's kernel (our native ones in `kernels/quantized_gemv.cpp`, which
stream the weights at close to the machine's memory bandwidth, where they are built, else PyTorch's). Those are
slower than a bf16 GEMM once a step carries more than a handful of tokens (docs/performance.md, "Large steps: int8
activations and dense products"). So each layer keeps both: the format's weight for small steps and its exact
dequantization, in the model dtype, for large ones. Both paths compute with the same quantized values; they differ
only in rounding order. What differs between formats (the kernel's layout, the small-step product, which file grid a
weight keeps) is the format's `LinearMethod`; the rest is here, once.

A fused weight (q/k/v, gate/up) whose parts the file stored in different formats (Q4_K_M's q and k Q4_K, v Q6_K)
becomes a `StackedLinear`: one layer per run of rows of one format, each computing as above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.kernels.int8_gemm import int8_gemm_packs, pack_int8_for_amx
from llmserve.layers.linear import dense_linear
from llmserve.quantization.int8_activations import int8_linear, pack_int8_weight, smoothing_scales
from llmserve.quantization.methods import LINEAR_METHODS, linear_method, methods_of
from llmserve.quantization.methods.int8 import quantize_int8

# Steps with at most this many tokens use the quantized kernel with Q8_0 inputs (one activation part), whose int4
# products of 32 tokens cost what 16 do with two, well below a step of 32 tokens on the dense bf16 weights; its int8
# layers too (docs/performance.md, "Quantized weight kernels"; `benchmarks/quantized_gemv.py --int8-layers`).
Q8_MAX_TOKENS = 32
# With the AMX int8 x int8 product, steps from this many tokens take it: from there it costs less than the int4
# kernel, and any count up to 16 is the same tile work
# (docs/performance.md, "Large steps: int8 activations and dense products"; `benchmarks/quantized_gemv.py
# --amx-int8`). Quality: what every step int8 x int8 costs over int4 ("Weight quantization quality") bounds what
# this costs.
AMX_MIN_TOKENS = 9
# A layer whose small-step kernel takes every step (the plan's quantized large steps): the largest int64, as the
# one-call decode stack reads it. Such a layer keeps no dense copy of its weight.
EVERY_STEP = 2**63 - 1


class WeightOnlyLinear(nn.Module):
    """A linear layer `y = x W^T (+ b)` over a quantized W (a bias, as Qwen2's q/k/v have, stays as it is).

    Two products, chosen once when the layer is built: the format's small-step kernel (steps of at most
    `max_quantized_tokens` tokens) and the large-step product (the exact dequantized weight, or int8 x int8
    once `use_int8_activations` ran). A call only picks between the two by its token count. With
    `max_quantized_tokens=EVERY_STEP` the small-step kernel takes every step and there is no large-step product:
    one copy of the weight, and a token's output the same bits whatever the step's other rows."""

    def __init__(self, weight: torch.Tensor, method: str, native_kernels: bool = False,
                 max_quantized_tokens: int | None = None, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, ...] | None = None, activation_parts: int = 2) -> None:
        """`method`: a registered weight format (`LINEAR_METHODS`). `native_kernels`: small steps through
        `torch.ops.llmserve` (the caller has loaded them), which keep a weight copy of their own layout instead of
        PyTorch's. `grid`: the file's own grid for this weight in this format (`Checkpoint.grids`), which the layer
        keeps instead of fitting one (ignored where it does not give this weight's values: a weight changed since it
        was read). `activation_parts`: how the native kernels take a small step's inputs, 2 int8 parts (~16 bits) or
        1 (Q8_0: an int8 per input, a scale per 32, half the integer work; the build plan chooses, see
        `Q8_MAX_TOKENS`)."""
        super().__init__()
        if activation_parts not in (1, 2):
            raise ValueError(f"activation_parts is 1 or 2, got {activation_parts}")
        self.method = method
        form = linear_method(method)
        self.activation_parts = activation_parts
        self.max_quantized_tokens = max_quantized_tokens or form.spec.small_step_tokens
        out_features, in_features = weight.shape
        self.native = native_kernels and form.native_packs(out_features, in_features)
        # the native kernel takes every step: no dense copy (nor its making, where the format can skip it)
        every_step = self.max_quantized_tokens >= EVERY_STEP and self.native
        if self.max_quantized_tokens >= EVERY_STEP and not self.native:  # PyTorch's kernel: its own crossover
            self.max_quantized_tokens = form.spec.small_step_tokens
        with torch.no_grad():
            prepared = form.prepare(weight, grid, self.native, dense=not every_step)
        self.layout = prepared.layout
        # the small-step kernel's weight and scales: the native layout, or PyTorch's
        self.register_buffer("qweight", prepared.qweight)
        self.register_buffer("scales", prepared.scales)
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # (none where the format keeps a file grid PyTorch's kernel cannot read: every step the dense product)
        self._small_step = None if prepared.qweight is None else form.small_step(self.native)
        # the large-step path: the quantized values themselves, in the model dtype (none where the small-step kernel
        # takes every step)
        self.register_buffer("weight", None if every_step else prepared.dequantized.to(weight.dtype))
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
            qweight, scales, _ = quantize_int8(self.weight.float() * smooth, dense=False)
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
        """The large-step product: "dense" (the dequantized weight), int8 x int8 on "onednn" or "amx", or "none"
        (the small-step kernel takes every step)."""
        if not self.uses_int8_activations:
            return "none" if self.weight is None and self.packed is None else "dense"
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


# A checkpoint's own grids by weight format, then by tensor name (`Checkpoint.grids`)
Grids = dict[str, dict[str, tuple[torch.Tensor, ...]]]


def layer_format(weights: str, sources: list[str], grids: Grids | None) -> tuple[str, tuple[torch.Tensor, ...] | None]:
    """One layer's format under a model's weights choice, and the file grid it keeps (None: fitted): the choice
    itself, or in a mix (`MIXED_METHODS`: "int4+int8") the first whose file grid holds every source of the layer
    (int4 where the file stored the weight on a 4-bit grid), else the last (int8)."""
    grids = grids or {}
    *held_first, last = methods_of(weights)
    for method in held_first:
        grid = _fused_grid(grids.get(method, {}), sources)
        if grid is not None:
            return method, grid
    return last, _fused_grid(grids.get(last, {}), sources)


@dataclass
class ModelQuantizer:
    """How a model's linears become `WeightOnlyLinear`s: the decoder layers' (each `nn.Linear`, its bias kept) and
    the output head, `head` weights, int8 unless asked (its logits rank every token; a speculative draft takes
    int4), a tied embedding staying as it is (a lookup reads one row). One layer at a time (`layer`), so that a
    model can be quantized as it loads (`build_model`'s `on_layer_loaded`): its dense weights never all exist.

    `method`: a registered format or a mix of them ("int4+int8": int4 where the file stored the weight on a 4-bit
    grid, int8 where it stored more bits). `native_kernels`: the caller has loaded `llmserve.kernels`; small steps
    use them. `max_quantized_tokens`: the largest step the small-step kernels take (default and ceiling: the layer's
    method's, Q8_MAX_TOKENS on Q8_0 inputs). `grids`: the checkpoint's own grids (`Checkpoint.grids`, Hugging Face
    names), which each format keeps (an int8 head only a Q6_K one: `head_grid`). `activation_parts`: the native
    kernels' small-step inputs (see `WeightOnlyLinear`). `every_step`: the native kernels take every step, output
    head included (`EVERY_STEP`; `max_quantized_tokens` is then ignored)."""

    method: str
    native_kernels: bool = False
    max_quantized_tokens: int | None = None
    grids: Grids | None = None
    head: str = "int8"
    activation_parts: int = 2
    every_step: bool = False

    def __post_init__(self) -> None:
        self.grids = {m: {k.removeprefix("model."): v for k, v in found.items()}
                      for m, found in (self.grids or {}).items()}

    def _cap(self, layer_method: str) -> int:
        return EVERY_STEP if self.every_step else small_step_cap(layer_method, self.max_quantized_tokens,
                                                                 self.activation_parts)

    def _quantized(self, weight: torch.Tensor, bias: torch.Tensor | None, sources: list[str]) -> WeightOnlyLinear:
        layer_method, grid = layer_format(self.method, sources, self.grids)
        return WeightOnlyLinear(weight, layer_method, self.native_kernels, self._cap(layer_method), bias, grid,
                                self.activation_parts)

    def layer(self, model: nn.Module, index: int) -> None:
        """Decoder layer `index`'s linears."""
        for prefix, module in list(model.layers[index].named_modules(prefix=f"layers.{index}")):
            for child_name, child in list(module.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                sources = model.checkpoint_sources(f"{prefix}.{child_name}.weight")
                runs = _format_runs(sources, module.source_rows(child_name),
                                    lambda s: _source_format(self.method, s, self.grids))
                if len(runs) == 1:
                    setattr(module, child_name, self._quantized(child.weight, child.bias, sources))
                else:  # rows the file stored in different formats: each run of rows in its own
                    setattr(module, child_name, StackedLinear([
                        self._quantized(child.weight[rows], None if child.bias is None else child.bias[rows], run)
                        for run, rows in runs]))
                self._forget(sources)

    def output_head(self, model: nn.Module) -> None:
        source = "embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        model.lm_head = WeightOnlyLinear(model.lm_head.weight, self.head, self.native_kernels, self._cap(self.head),
                                         grid=head_grid(self.head, self.grids, source),
                                         activation_parts=self.activation_parts)
        self._forget([source])

    def _forget(self, sources: list[str]) -> None:
        """Drop the grids of weights already quantized: where the quantizer holds the only references (the
        checkpoint let go of them, as a model quantized while it loads does), a 1.5B model's int4 grids are 0.3 GB
        of its start's peak."""
        for found in self.grids.values():
            for source in sources:
                found.pop(source, None)

    def __call__(self, model: nn.Module) -> nn.Module:
        """The whole model's, layers and head (a pipeline stage before the last holds none)."""
        for index in range(len(model.layers)):
            self.layer(model, index)
        if model.lm_head is not None:
            self.output_head(model)
        return model


def quantize_model(model: nn.Module, method: str, native_kernels: bool = False,
                   max_quantized_tokens: int | None = None, grids: Grids | None = None, head: str = "int8",
                   activation_parts: int = 2, every_step: bool = False) -> nn.Module:
    """Every linear of a loaded model quantized (see `ModelQuantizer` for the arguments)."""
    return ModelQuantizer(method, native_kernels, max_quantized_tokens, grids, head, activation_parts,
                          every_step)(model)


def head_grid(head: str, grids: Grids, source: str) -> tuple[torch.Tensor, ...] | None:
    """The file grid an output head keeps: an int8 head a Q6_K one (6.625 bits a weight, exact). A Q8_0 or Q5_0 head
    is re-quantized per row: 8 bits a weight against the grouped layout's 8.5, on the step's largest product (SmolLM2's
    tied Q8_0 embedding is a third of its step's bytes); an int4 head (a draft's) is fitted."""
    grid = grids.get(head, {}).get(source) if head == "int8" else None
    return grid if grid is not None and len(grid) == 2 else None


def _source_format(method: str, source: str, grids: Grids) -> tuple[str, int]:
    """How a checkpoint tensor is computed under `method`: its layer format, and the file's own grid it keeps, by
    its tensors' count (int4: Q4_K's super-blocks or a fitted fp16 one; int8: Q6_K's 6 bits (2), Q8_0's or Q5_0's
    d per 32 (1), or per row (0))."""
    layer_method, grid = layer_format(method, [source], grids)
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
    """A fused weight's grid: its sources' in row order, where every one has one of the same kind (one source: its
    own, not copied)."""
    found = [grids.get(s) for s in sources]
    if None in found or len({len(g) for g in found}) > 1:
        return None
    return found[0] if len(found) == 1 else tuple(torch.cat(parts) for parts in zip(*found, strict=True))


def small_step_cap(method: str, asked: int | None, activation_parts: int) -> int:
    """The largest step a layer's small-step kernel takes: `asked`, at most its method's crossover (Q8_0 inputs'
    for either native kernel, whose integer work they halve). The build plan bounds the one-call decode stack by
    it too."""
    ceiling = Q8_MAX_TOKENS if activation_parts == 1 else LINEAR_METHODS[method].small_step_tokens
    return min(asked or ceiling, ceiling)
