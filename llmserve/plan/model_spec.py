"""What a model costs in memory and arithmetic: weight bytes, KV bytes per token, FLOPs per token.

Why from a handful of numbers: capacity planning must work for models we cannot run here (an 8B or 70B
on a GPU) as well as the registered ones, whose shape comes from their GGUF header without loading a
weight. Everything else in `plan/` sees a model only through `ModelSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.loader.gguf_header import read_gguf_header
from llmserve.quantization.methods import LINEAR_METHODS

GB = 1e9  # planning speaks vendor units: memory "80 GB", bandwidth "3.35 TB/s"


@dataclass(frozen=True)
class WeightFormat:
    """Bits per weight plus one scale (and offset) of `scale_bytes` per group of `group_size` weights."""

    bits: int
    group_size: int = 0  # 0: no scales
    scale_bytes: int = 0

    @property
    def bytes_per_weight(self) -> float:
        scales = self.scale_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scales


# dense, and the engine's registered formats (quantization/methods/: int4 groups of 32 with a scale and offset,
# GGUF's Q4_1; int8 one scale per 128 weights, as planned)
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat(32),
    "bf16": WeightFormat(16),
    "fp16": WeightFormat(16),
    **{name: WeightFormat(spec.bits, spec.group_size, spec.scale_bytes) for name, spec in LINEAR_METHODS.items()},
}
KV_DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0,
                                    "int8": 1.0}
# the float32 scale after each 1-byte cache row (kv_cache/kv_quant.py's SCALE_BYTES; that module needs torch,
# which the planner does without)
KV_ROW_SCALE_BYTES = 4


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as memory and FLOPs go."""

    name: str
    num_params: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None  # query heads; None: attention FLOPs are left out (see attention_flops)
    max_context: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("num_params", "num_layers", "num_kv_heads", "head_dim"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"model {field_name} must be > 0, got {getattr(self, field_name)}")
        if self.num_heads is not None and self.num_heads < self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be >= num_kv_heads ({self.num_kv_heads})")

    def weight_bytes(self, quantization: str) -> float:
        return self.num_params * _weight_format(quantization).bytes_per_weight

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """K and V, every layer: 2 x layers x kv_heads x bytes per row; a 1-byte row (int8, fp8) carries its
        float32 scale after its head_dim values, as llmserve's cache stores it (kv_cache/kv_quant.py)."""
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"kv dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
        element = KV_DTYPE_BYTES[kv_dtype]
        row = self.head_dim * element + (KV_ROW_SCALE_BYTES if element == 1.0 else 0)
        return 2 * self.num_layers * self.num_kv_heads * row

    def linear_flops_per_token(self) -> float:
        """A forward pass multiplies each weight once per token: 2 FLOPs (multiply, add) per parameter."""
        return 2.0 * self.num_params

    def attention_flops(self, query_key_pairs: float) -> float:
        """QK^T and AV: 2 x 2 FLOPs per (query, key) pair, per query head dimension and layer."""
        if self.num_heads is None:
            return 0.0
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * query_key_pairs


@dataclass(frozen=True)
class MemoryFit:
    """Weights + KV against usable memory; concurrency counted in sequences of `tokens_per_seq` tokens."""

    memory_bytes: float
    usable_bytes: float
    weight_bytes: float
    kv_bytes_per_token: float
    tokens_per_seq: int
    max_concurrency: int  # sequences whose whole KV fits beside the weights

    @property
    def weights_fit(self) -> bool:
        return self.max_concurrency >= 1

    def kv_bytes(self, concurrency: int) -> float:
        return concurrency * self.tokens_per_seq * self.kv_bytes_per_token

    def fits(self, concurrency: int) -> bool:
        return self.weight_bytes + self.kv_bytes(concurrency) <= self.usable_bytes


def memory_fit(model: ModelSpec, quantization: str, kv_dtype: str, memory_gb: float, tokens_per_seq: int,
               usable_fraction: float = 0.9) -> MemoryFit:
    """How many sequences' KV fit beside the weights in `usable_fraction` of the memory (the rest is the
    runtime's: activations, buffers, the CUDA context; vLLM's gpu_memory_utilization is the same idea)."""
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable_fraction must be in (0, 1], got {usable_fraction}")
    if tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be >= 1, got {tokens_per_seq}")
    memory = memory_gb * GB
    usable = memory * usable_fraction
    weights = model.weight_bytes(quantization)
    per_token = model.kv_bytes_per_token(kv_dtype)
    free = usable - weights
    max_conc = max(0, math.floor(free / (tokens_per_seq * per_token))) if free > 0 else 0
    return MemoryFit(memory, usable, weights, per_token, tokens_per_seq, max_conc)


def model_from_gguf(path: str, name: str) -> ModelSpec:
    """The shape from a GGUF header: parameters counted from the tensor shapes, the rest from metadata."""
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not arch or f"{arch}.block_count" not in meta:
        raise ValueError(f"{path}: no '<arch>.block_count' in the GGUF metadata")
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    return ModelSpec(
        name=name,
        num_params=float(header.num_params),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        # a head's width: Gemma's (256) is not hidden / heads, and its file has no rotary dimension
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count",
                                                                           hidden // heads)),
        num_heads=heads,
        max_context=int(meta[f"{arch}.context_length"]) if f"{arch}.context_length" in meta else None,
    )


def registered_model(name: str) -> ModelSpec:
    """A registered model (e.g. smollm2-135m) or a GGUF path; the file must be installed (it is not
    assembled here: planning should not download 1 GB)."""
    from llmserve.loader.default_models import EMBEDDED_MODELS, PARTED_MODELS, installed_path, registered_name

    key = registered_name(name)
    if key is None:
        if name.endswith(".gguf"):
            return model_from_gguf(name, name.rsplit("/", 1)[-1].removesuffix(".gguf"))
        known = ", ".join([*EMBEDDED_MODELS, *PARTED_MODELS])
        raise ValueError(f"model {name!r} is neither a registered name ({known}) nor a .gguf file; or give its "
                         "shape: --params --layers --kv-heads --head-dim")
    entry = EMBEDDED_MODELS.get(key) or PARTED_MODELS[key]
    path = installed_path(entry)
    if path is None:
        raise ValueError(f"model {key!r} is not installed (llmserve download {key}); or give its shape: "
                         "--params --layers --kv-heads --head-dim")
    return model_from_gguf(path, key)


def _weight_format(quantization: str) -> WeightFormat:
    if quantization not in WEIGHT_FORMATS:
        raise ValueError(f"quantization must be one of {sorted(WEIGHT_FORMATS)}, got {quantization!r}")
    return WEIGHT_FORMATS[quantization]
