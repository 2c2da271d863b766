"""Engine configuration: one frozen dataclass per concern, gathered in `EngineConfig`.

Values are checked where they are made (bad ones raise `ValueError` naming the argument); anything
derived from them is computed by a method, never written back, so a config can be shared freely. Each
field carries its help text: the command-line flags (`add_engine_arguments`), the offline API's
keywords (`engine_config(**options)`) and `--help` are generated from these fields, so they agree by
construction. What the engine then makes of a config on a given host is the build plan's business
(engine/build_plan.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from llmserve.quantization.methods import LINEAR_METHODS, MIXED_METHODS

# Names only: importing torch here would make every `--help` pay for it.
DTYPES = ("float32", "bfloat16", "float16")
# weight-only, the registered formats and their mixes (quantization/methods/); awq: int4 after activation-aware
# scales (quantization/awq.py)
QUANTIZATION_METHODS = (*LINEAR_METHODS, *MIXED_METHODS, "awq")
KERNEL_CHOICES = ("auto", "native", "torch")
LARGE_STEP_CHOICES = ("auto", "quantized", "int8", "dense")
# KV cache formats (vLLM's names): the model dtype, or 1-byte values with a float32 scale per token and
# KV head (kv_cache/kv_quant.py). "fp8" is vLLM's alias of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


def _option(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its help (and, where given, `choices`, a `flag` name, or `cli=False`)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and in what precision."""

    model: str | None = _option(None, "registered name, GGUF file or Hugging Face directory (None: the embedded "
                                "default, smollm2-135m)", cli=False)
    dtype: str = _option("auto", "weight and activation dtype; auto: bfloat16 where the CPU multiplies it natively "
                         "(AVX512-BF16 or AMX), else float32", choices=("auto", *DTYPES))
    max_model_len: int | None = _option(None, "longest prompt + output in tokens (default: the model's context "
                                        "length)")
    seed: int = _option(0, "engine random seed (requests without a seed of their own draw from it)")
    device: str = _option("auto", "torch device: auto (a CUDA GPU where there is one and nothing asked for is "
                          "CPU-only), cpu, or cuda (PyTorch kernels, weights as loaded, decode steps as CUDA graphs; "
                          "the native kernels and quantization are CPU-only)")
    quantization: str | None = _option("auto", "weight-only quantization of the linear layers (int4: groups of 32 "
                                       "on GGUF Q4_1's grid, a 4-bit file's own grid where it has one; output head "
                                       "int8; int4+int8: int4 where the file is 4-bit, int8 where it holds more "
                                       "bits; fp8: e4m3 per output channel, an FP8 checkpoint's own bytes and "
                                       "scales); auto = int4 where the file's weights are 4-bit (Q4_0, Q4_1, Q4_K), "
                                       "int4+int8 for a mostly 4-bit K-quant mix (Q4_K_M), int4 for an AWQ or GPTQ "
                                       "checkpoint, "
                                       "fp8 for an FP8 checkpoint, else the weights as loaded; awq = int4 in groups "
                                       "of 32 after AWQ's activation-aware scales, searched at start on the "
                                       "calibration text (an AWQ checkpoint's own are used as stored; `llmserve "
                                       "quantize` writes one); "
                                       "none = the weights as loaded",
                                       choices=("auto", "none", *QUANTIZATION_METHODS), flag="-q")
    large_steps: str = _option("auto", "with quantized weights: how steps of many tokens (batches, prompts) "
                               "multiply; quantized = on the same native kernels as small steps, over the quantized "
                               "weights themselves (no second copy of them, and a token's product the same bits "
                               "whatever else its step holds); int8 = per-token int8 activations times "
                               "SmoothQuant-smoothed int8 weights, calibrated at start (a second, int8 copy; +0.2-0.3 "
                               "%% perplexity on SmolLM2); dense = the dequantized weights in the model dtype (a "
                               "second copy of twice the bytes); auto = quantized where the native kernels take Q8_0 "
                               "inputs (K-quant mixes, drafts: there it is fastest), else int8 for a 4-bit file on a "
                               "CPU with VNNI, else dense",
                               choices=LARGE_STEP_CHOICES)
    q8_activations: bool | None = _option(None, "with int4 weights on the native kernels: a small step's inputs "
                                          "(decode batches, short prompt chunks; int4 and int8 layers) quantized as "
                                          "llama.cpp's Q8_0 (an int8 per input, a scale per 32) instead of split to "
                                          "~16 bits: half the integer work, 1.7x faster int4 products at 8+ "
                                          "tokens; default: on for a K-quant mix file (Q4_K_M: +0.03 %% perplexity on "
                                          "Qwen2.5-Coder-1.5B) and "
                                          "a speculative draft, off for a 4-bit-only file (Q4_1: +1.45 %% on "
                                          "SmolLM2)")
    huge_pages: bool | None = _option(None, "with quantized weights on the native kernels: the weights a decode "
                                      "step streams copied, in the order it reads them, into one arena on 2 MiB "
                                      "transparent huge pages (Linux); default: on where the host allows them on "
                                      "request", cli=False)
    compile: bool = _option(False, "torch.compile each decode-only step as one graph (native attention) or each "
                            "decoder layer (PyTorch attention): faster steps for ~1-2 min more start-up; off "
                            "where every decode step already runs as one native call (quantized weights)")
    enforce_eager: bool = _option(False, "on CUDA: run decode steps layer by layer instead of replaying captured "
                                  "CUDA graphs (to debug or compare)")
    kernels: str = _option("auto", "llmserve's native CPU kernels (paged decode attention, quantized products, "
                           "fused norm/rotary/SwiGLU, argmax): auto = where they build and pay (the fused "
                           "elementwise ops in bfloat16 only), native = always (an error where they cannot run), "
                           "torch = PyTorch's ops only", choices=KERNEL_CHOICES)
    draft: bool = _option(False, "a speculative draft (the engine sets it for the draft it builds): its weights "
                          "decide which tokens are proposed, never which are kept, so auto picks the fastest "
                          "ones, output head included", cli=False)

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {list(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.kernels == "native" and not self.device.startswith(("cpu", "auto")):
            raise ValueError(f"the native kernels are CPU-only, not {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, "auto", "none", *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {['auto', 'none', *QUANTIZATION_METHODS]} or None, got "
                             f"{self.quantization!r}")
        if self.quantization in QUANTIZATION_METHODS and not self.device.startswith(("cpu", "auto")):
            raise ValueError(f"quantization {self.quantization!r} has CPU kernels only, not {self.device!r}")
        if self.large_steps not in LARGE_STEP_CHOICES:
            raise ValueError(f"large_steps must be one of {list(LARGE_STEP_CHOICES)}, got {self.large_steps!r}")
        if self.large_steps != "auto" and self.quantization in (None, "none"):
            raise ValueError(f"large_steps={self.large_steps!r} needs quantization ('int8' or 'int4'): it chooses "
                             "their large-step path")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget the block count is derived from."""

    block_size: int = _option(16, "tokens per KV cache block")
    kv_cache_memory_gb: float | None = _option(None, "KV cache size in GiB (default: --kv-cache-memory-fraction of "
                                               "the memory free at start)")
    kv_cache_memory_fraction: float = _option(0.1, "KV cache size as a fraction of the memory available at start "
                                              "(on CUDA, the GPU's free memory)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of shared prompt prefixes across requests")
    kv_cache_dtype: str = _option("auto", "KV cache format: auto (the model dtype), int8 or fp8_e4m3 (1 byte a "
                                  "value and a scale per token and KV head: about twice the tokens in the same "
                                  "memory)", choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: how many sequences and tokens one step may carry."""

    max_num_seqs: int = _option(64, "sequences per batch")
    # A step's cost grows with its tokens; on a small CPU a step of 512 is the most a running stream should wait
    # for its next token while prompts are prefilled. Smaller steps smooth the streams but lengthen the time to a
    # first token (docs/performance.md, "Prefix caching and chunked prefill").
    max_num_batched_tokens: int = _option(512, "tokens per engine step: decodes first, then prompt chunks")
    # A prompt longer than this is prefilled in several steps so running decodes keep flowing.
    long_prefill_token_threshold: int = _option(256, "largest prompt chunk one request runs per step; longer "
                                                "prompts are prefilled over several steps so running streams "
                                                "keep flowing")
    # How many such long prompts may be part-way through their prefill at once. Two chunks deep into
    # long prompts in one step double its attention cost (the step every running stream waits for);
    # with one, shorter prompts pass a waiting long one instead of queueing behind it (vLLM's name).
    max_long_partial_prefills: int = _option(1, "prompts longer than the threshold prefilled at once; shorter "
                                             "prompts pass the others")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "max_long_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism over torch.distributed (gloo on CPU, NCCL on CUDA): worker processes the
    engine starts, one per rank past the first (distributed/executor.py); tensor_parallel_size x
    pipeline_parallel_size ranks in all."""

    tensor_parallel_size: int = _option(1, "ranks the model is split over (heads, MLP units, vocabulary); the "
                                        "engine starts one worker process per rank past the first")
    pipeline_parallel_size: int = _option(1, "stages the decoder layers are split over, each stage "
                                          "tensor_parallel_size ranks; a step's requests cross them in "
                                          "micro-batches")
    threads_per_rank: int | None = _option(None, "CPU threads of each rank (default: the engine's threads / ranks)")
    collective_timeout_s: float = _option(60.0, "seconds a rank waits in a collective before the group is "
                                          "declared failed (a dead or hung rank)")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")

    @property
    def world_size(self) -> int:
        """Ranks in all: the engine's process and one worker per rank past it."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys): proposals verified by the model in one step."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most proposal tokens a request carries into one step
    model: str | None = None  # draft_model: the draft (registered name, GGUF file or HF directory)
    # draft_model: the share of the KV cache budget the draft's own cache takes (the target keeps the rest)
    draft_kv_cache_fraction: float = 0.25
    prompt_lookup_max: int = 4  # ngram: longest ending of the sequence looked up
    prompt_lookup_min: int = 2  # ngram: shortest
    # no proposals at all while this many requests run (None: the speculator's cost model alone decides)
    disable_by_batch_size: int | None = None
    # True: per step, only the proposal tokens the measured step cost and each request's acceptance rate say
    # pay; False: every proposal the proposer finds, num_speculative_tokens long (vLLM's behaviour)
    adaptive: bool = True
    # the engine's own choice (`"auto"`, the default), not the user's (the plan says which)
    automatic: bool = False

    def __post_init__(self) -> None:
        self._check_method(self.method)
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (the draft), and only it "
                             f"takes one; got method {self.method!r} with model {self.model!r}")
        if not 0 < self.draft_kv_cache_fraction < 1:
            raise ValueError(f"speculative_config: draft_kv_cache_fraction must be in (0, 1), got "
                             f"{self.draft_kv_cache_fraction}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got "
                             f"{self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")

    @staticmethod
    def _check_method(method: str) -> None:
        if method in ("eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(f"speculative_config: method {method!r} is not supported yet; the methods are "
                             f"{list(SPECULATIVE_METHODS)}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; the methods are "
                             f"{list(SPECULATIVE_METHODS)}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | str | None:
        """From the option's forms: a dict (LLM(speculative_config={...})), JSON (--speculative-config), an
        instance, None / "none" / "off" (no speculation), or "auto" (returned as is: the build plan decides)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("none", "off", ""):
                return None
            if value.strip().lower() == "auto":
                return "auto"
            if value.strip() in SPECULATIVE_METHODS:  # a method alone: its defaults
                value = json.dumps({"method": value.strip()})
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object or dict, got {value!r}")
        cls._check_method(value.get("method", cls.method))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; the keys are {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # "auto": the build plan decides (engine_config's default); None: none
    speculative: SpeculativeConfig | str | None = None


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
_TYPES = {"int": int, "float": float, "str": str}


SPECULATIVE_HELP = ("speculative decoding: auto (the default: n-gram prompt lookup where the one-call decode stack "
                    "runs, while few requests run), off, or as JSON: {\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 4, "
                    "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": null, "
                    "\"adaptive\": true}, or {\"method\": \"draft_model\", \"model\": \"qwen2.5-coder-0.5b\", "
                    "\"num_speculative_tokens\": 4} "
                    "(vLLM's keys; adaptive: proposals only where the measured step cost says they pay)")


def engine_options() -> dict[str, Any]:
    """Every engine option by name, with its default: what `LLM(...)` and `engine_config` accept."""
    return {**{f.name: f.default for cls in _SECTIONS.values() for f in fields(cls)},
            "speculative_config": "auto"}


def engine_config(**options: Any) -> EngineConfig:
    """An `EngineConfig` from flat options (the offline API's keywords, the CLI's flags): each goes to the
    sub-config with a field of its name. Unknown names raise TypeError; bad values ValueError."""
    known = engine_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; the options are {sorted(known)}")
    parts = {section: cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})
             for section, cls in _SECTIONS.items()}
    return EngineConfig(**parts, speculative=SpeculativeConfig.parse(
        options.get("speculative_config", known["speculative_config"])))


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         defaults: dict[str, Any] | None = None, skip: tuple[str, ...] = ()) -> None:
    """One flag per engine option (`--max-num-seqs` for max_num_seqs; a True boolean as `--no-...`), its
    help from the field. `defaults` overrides a default for this command; `skip` leaves options out (a
    command whose own flag has that name)."""
    defaults = defaults or {}
    for cls in _SECTIONS.values():
        for f in fields(cls):
            if not f.metadata.get("cli", True) or f.name in skip:
                continue
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"]
            if f.type == "bool | None":  # None: the engine decides
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
                continue
            if f.type == "bool":
                if default:
                    parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                        help=f"do not: {help_text} (on by default)")
                else:
                    parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
                continue
            names = [flag] + ([f.metadata["flag"]] if "flag" in f.metadata else [])
            if "default" not in help_text:
                help_text += " (default: %(default)s)"
            parser.add_argument(*names, dest=f.name, type=_TYPES[f.type.split(" |")[0]], default=default,
                                choices=f.metadata.get("choices"), help=help_text)
    if "speculative_config" not in skip:
        parser.add_argument("--speculative-config", dest="speculative_config", metavar="JSON",
                            default=defaults.get("speculative_config", "auto"), help=SPECULATIVE_HELP)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of parsed `add_engine_arguments` flags (and `overrides`, e.g. the model)."""
    options = {name: getattr(args, name) for name in engine_options() if hasattr(args, name)}
    return engine_config(**{**options, **overrides})
