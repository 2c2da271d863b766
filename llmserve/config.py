"""Engine configuration: one frozen dataclass per concern, gathered in `EngineConfig`.

Values are checked where they are made (bad ones raise `ValueError` naming the argument); anything
derived from them is computed by a method, never written back, so a config can be shared freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Names only: importing torch here would make every `--help` pay for it.
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, see quantization/weight_only.py
# where the engine has a native CPU kernel beside a PyTorch path: attention_backend (layers/attention.py),
# quantized_kernels (quantization/weight_only.py), elementwise_kernels (kernels/fused_elementwise.cpp)
KERNEL_CHOICES = ("auto", "native", "torch")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and in what precision.

    `model` is a registered name (see `loader.default_models`), a GGUF file or a Hugging Face
    directory; None means the embedded default model.
    """

    model: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    device: str = "cpu"
    # weight-only quantization of the linear layers: None, "int8" or "int4" (see quantization/)
    quantization: str | None = None
    # with quantization: steps of many tokens multiply int8 activations (one scale per token) by SmoothQuant-
    # smoothed int8 weights, calibrated at load (quantization/int8_activations.py): ~1.4x faster batch
    # decode steps and prompts, at +0.7 % perplexity over int4 on the default model
    int8_activations: bool = False
    # torch.compile: with native attention, each decode-only step as one graph of the whole model
    # (engine/decode_graph.py); with torch attention, each decoder layer (attention eager). Paid for with
    # ~1-2 min of compilation at start-up (the engine warms up before it serves)
    compile: bool = False
    # decode attention: "native" = the C++ kernel of llmserve/kernels (CPU), "torch" = batched PyTorch ops,
    # "auto" = native where it builds and runs (CPU), else torch
    attention_backend: str = "auto"
    # with quantization, the small steps' kernels: "native" = llmserve/kernels/quantized_gemv.cpp (CPUs with
    # AVX-512 VNNI), "torch" = PyTorch's weight-only kernels, "auto" = native where it builds vectorized.
    # With int8_activations, anything but "torch" also runs the int8 x int8 products on
    # llmserve/kernels/int8_gemm.cpp where the CPU has AMX (else oneDNN)
    quantized_kernels: str = "auto"
    # the decoder layer's norms, rotary and SwiGLU gate in steps that run eagerly (prompts, mixed steps), and
    # greedy sampling's argmax: "native" = llmserve/kernels/fused_elementwise.cpp and argmax.cpp (CPU; one op
    # each instead of ~25 small ones a layer; an argmax several times faster than PyTorch's),
    # "torch" = PyTorch's ops, "auto" = native in bfloat16 where the kernels build (CPU; "native" also takes
    # float32)
    elementwise_kernels: str = "auto"

    def __post_init__(self) -> None:
        for option in ("attention_backend", "quantized_kernels", "elementwise_kernels"):
            if getattr(self, option) not in KERNEL_CHOICES:
                raise ValueError(f"{option} must be one of {list(KERNEL_CHOICES)}, got {getattr(self, option)!r}")
        if self.attention_backend == "native" and not self.device.startswith("cpu"):
            raise ValueError(f"the native attention kernel is CPU-only, not {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {self.quantization!r}"
            )
        if self.quantization is not None and not self.device.startswith("cpu"):
            raise ValueError(f"quantization {self.quantization!r} has CPU kernels only, not {self.device!r}")
        if self.int8_activations and self.quantization is None:
            raise ValueError("int8_activations needs quantization ('int8' or 'int4'): it is their large-step path")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget the block count is derived from."""

    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # explicit budget; wins over the fraction
    kv_cache_memory_fraction: float = 0.1  # of the memory available when the engine starts
    enable_prefix_caching: bool = True  # share the KV of common prompt prefixes across requests

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: how many sequences and tokens one step may carry."""

    max_num_seqs: int = 64
    # A step's cost grows with its tokens; on a 2-core CPU 512 tokens take ~0.4-1 s (more when a chunk
    # attends to a long context), the most a running stream should wait for its next token while prompts
    # are prefilled. 256 lowered ITL p99 but doubled TTFT p50 (benchmarks/README.md).
    max_num_batched_tokens: int = 512
    # A prompt longer than this is prefilled in several steps so running decodes keep flowing.
    long_prefill_token_threshold: int = 256
    # How many such long prompts may be part-way through their prefill at once. Two chunks deep into
    # long prompts in one step double its attention cost (the step every running stream waits for);
    # with one, shorter prompts pass a waiting long one instead of queueing behind it (vLLM's name).
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "max_long_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), so bf16 is faster, not slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """The dtype 'auto' stands for: bfloat16 where the hardware has it natively, else float32."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
