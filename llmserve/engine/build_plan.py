"""The build plan: every choice about how the model runs, made once, from the config, the model and this
host, before anything is built, and logged as one block that says what was chosen and why.

Why one plan: the engine has a native and a PyTorch way of doing most things (attention, the layers'
elementwise ops, quantized products, argmax), two ways of running a step (a compiled graph, one native
call for the whole decoder) and several weight formats. Deciding each where it is used spread the
decisions over every layer call and let them disagree. Here they are resolved together (the fused
decode stack, for one, needs native attention, native elementwise ops and native int4 products), the
model is built from the plan in one pass, and each layer holds the method it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import psutil
import torch

from llmserve.config import QUANTIZATION_METHODS, EngineConfig, SpeculativeConfig
from llmserve.distributed.pipeline_parallel import stage_layers
from llmserve.distributed.tensor_parallel import check_shardable
from llmserve.engine.cuda_graphs import MAX_GRAPH_BATCH
from llmserve.host import cpu_has_native_bf16, cpu_has_vnni, transparent_huge_pages
from llmserve.kernels import amx_int8_gemm, load_cpu_kernels, native_quantized_kernels
from llmserve.kernels.quantized_gemv import int4_packs
from llmserve.kv_cache.kv_cache_spec import KVCacheSpec
from llmserve.layers.attention import ATTENTION_BACKENDS, choose_attention
from llmserve.loader.default_models import registered_draft
from llmserve.models.config import ModelConfig
from llmserve.quantization.methods import LINEAR_METHODS, MIXED_METHODS, methods_of, small_step_tokens
from llmserve.quantization.weight_only import AMX_MIN_TOKENS, Q8_MAX_TOKENS, small_step_cap

logger = logging.getLogger(__name__)

# Speculation by default ("auto"): n-gram prompt lookup while fewer than this many requests run. Where the one
# native call runs the decoder, a step streams the weights once whatever its handful of tokens, so a kept
# proposal is a token for little more than the step's own cost. Under load a step is compute-bound and the
# proposals no longer pay, so not there (docs/performance.md, "Speculative decoding").
AUTO_SPECULATION_BELOW = 4
# Where the model has a registered draft (loader/default_models.py) that is installed, "auto" drafts with it instead,
# one request at a time: a draft keeps far more of its proposals than n-gram lookup does, but beside a second
# request the draft's steps cost more than they keep (docs/performance.md, "Speculative decoding").
AUTO_DRAFT_BELOW = 2
AUTO_DRAFT_MEASURED = "Qwen2.5-Coder-1.5B with the 0.5B, one request: 1.6x on HumanEval prompts (n-gram lookup ~1.0x)"


class Kernels(StrEnum):
    """Whose code computes a piece: llmserve's native CPU kernels or PyTorch's ops; NONE where the piece is not
    there (dense weights take no small-step kernel)."""

    NATIVE = "native"
    TORCH = "torch"
    NONE = ""


class Int8Products(StrEnum):
    """Which kernel multiplies int8 x int8 in large steps: llmserve's AMX kernel or oneDNN's; NONE without int8
    activations."""

    AMX = "amx"
    ONEDNN = "onednn"
    NONE = ""


class LargeSteps(StrEnum):
    """How quantized weights multiply steps past the small-step kernels' crossover (`ModelConfig.large_steps`):
    on those same kernels (no second copy of the weights, a token's product the same bits whatever its step holds),
    int8 x int8 (SmoothQuant), or dense over the dequantized weights; dense weights: DENSE."""

    QUANTIZED = "quantized"
    INT8 = "int8"
    DENSE = "dense"


class CompileMode(StrEnum):
    """What torch.compile compiles: each decode-only step as one graph, each decoder layer, or nothing."""

    GRAPH = "graph"
    LAYERS = "layers"
    OFF = "off"


class StepRoute(StrEnum):
    """How one step runs (`STEP_ROUTES`)."""

    FUSED = "fused"  # the decoder as one native call
    CUDA_GRAPH = "cuda graph"  # a captured CUDA graph replayed
    GRAPH = "graph"  # the compiled decode graph
    EAGER = "eager"  # layer by layer, any step


@dataclass(frozen=True)
class BuildPlan:
    """Each choice is an enum where the set is fixed here, or a registry's name where it is open (weights: a
    `quantization.methods` name or a mix of them, or "as loaded"; attention: an `ATTENTION_BACKENDS` name)."""

    device: str
    dtype: torch.dtype
    weights: str  # "as loaded" | "int8" | "int4" | "int4+int8" (linear layers: int4 where the file is 4-bit,
    # int8 where it holds more bits)
    small_step_kernels: Kernels  # quantized weights' small-step products (NONE: dense weights)
    small_step_max_tokens: int  # steps up to this many tokens take the small-step kernel (0: dense weights)
    large_steps: LargeSteps  # quantized weights: how steps past `small_step_max_tokens` multiply
    int8_products: Int8Products  # with int8 large steps, whose kernel
    attention: str  # "native" (the C++ paged kernel) | "torch"
    elementwise: Kernels  # the layers' norms, rotary and gate in eager steps
    argmax: Kernels  # greedy sampling
    compile: CompileMode
    # decode-only steps run as one native call, up to this many tokens on the small-step kernels (0: never)
    fused_decode_max_tokens: int
    kv_cache: KVCacheSpec
    num_kv_blocks: int
    max_model_len: int
    head: str = "int8"  # a quantized model's output head: "int8" (it ranks every token), "int4" for a draft
    activation_parts: int = 2  # the native int4 and int8 kernels' inputs: 2 int8 parts (~16 bits) or 1 (Q8_0)
    tensor_parallel_size: int = 1  # ranks the model is split over (distributed/)
    pipeline_stages: tuple[range, ...] = ()  # each pipeline stage's decoder layers (distributed/); () for one stage
    speculative: SpeculativeConfig | None = None  # speculative decoding, as asked or as "auto" resolved it
    cuda_graph_max_tokens: int = 0  # decode-only steps up to this many tokens replay CUDA graphs (0: never)
    huge_pages: bool = False  # the streamed weights in one huge-page arena (quantization/weight_arena.py)
    # a token's output bits do not depend on the rest of its step: quantized products at every size, and attention
    # on the native decode kernel for prompt tokens too (layers/attention/native.py)
    batch_invariant: bool = False
    reasons: dict[str, str] = field(default_factory=dict, compare=False)  # why, per choice

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.pipeline_stages) or 1

    @property
    def int8_activations(self) -> bool:
        """Large steps multiply int8 x int8, after a calibration at start."""
        return self.large_steps == LargeSteps.INT8

    def large_step_products(self) -> str:
        return {LargeSteps.QUANTIZED: "the small-step kernels (no second copy of the weights)",
                LargeSteps.INT8: f"int8 x int8 ({self.int8_products})",
                LargeSteps.DENSE: "dense products"}[self.large_steps]

    def step_route(self, decode_only: bool, num_tokens: int, has_graph: bool) -> StepRoute:
        """How a step runs: the first of `STEP_ROUTES` that can run it. The one place this is decided."""
        return next(name for name, can_run in STEP_ROUTES if can_run(self, decode_only, num_tokens, has_graph))

    def describe(self) -> str:
        rows = [
            ("device", self.device),
            ("dtype", str(self.dtype).removeprefix("torch.")),
            ("weights", self.weights + (f", output head {self.head}" if self.head != "int8" else "")),
            ("small steps", f"{self.small_step_kernels} kernels, <= {self.small_step_max_tokens} tokens"
             + (", inputs as Q8_0" if self.activation_parts == 1 else "") if self.small_step_max_tokens else "-"),
            ("large steps", self.large_step_products()),
            *([("weight memory", "one arena on 2 MiB huge pages, in the order a step reads it" if self.huge_pages
                else "the allocator's pages")] if "weight memory" in self.reasons else []),
            ("attention", self.attention),
            ("determinism", "a token's bits whatever else its step holds" if self.batch_invariant else
             "a token's last bits may depend on its step's other rows"),
            ("elementwise", self.elementwise),
            ("argmax", self.argmax),
            *([("tensor parallel", f"{self.tensor_parallel_size} ranks")] if self.tensor_parallel_size > 1 else []),
            *([("pipeline parallel", f"{self.pipeline_parallel_size} stages, layers " + ", ".join(
                f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in self.pipeline_stages))]
              if self.pipeline_stages else []),
            ("decode steps", self._routes()),
            *([("speculation", self._speculation_row())] if self.speculative or "speculation" in self.reasons else []),
            ("KV cache", f"{self.num_kv_blocks} blocks x {self.kv_cache.block_size} tokens "
             f"({self.num_kv_blocks * self.kv_cache.block_size} tokens, "
             f"{self.num_kv_blocks * self.kv_cache.bytes_per_block / 2**30:.2f} GiB, "
             f"{str(self.kv_cache.dtype).removeprefix('torch.')}), max_model_len {self.max_model_len}"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {value}" + (f"  ({self.reasons[name]})" if name in self.reasons else "")
                 for name, value in rows]
        return "build plan:\n" + "\n".join(lines)

    def _speculation_row(self) -> str:
        spec = self.speculative
        if spec is None:
            return "off"
        what = ("n-gram prompt lookup" if spec.method == "ngram" else f"draft model {spec.model}") + \
            f", up to {spec.num_speculative_tokens} tokens" + (", where they pay" if spec.adaptive else "")
        return what + (f", while fewer than {spec.disable_by_batch_size} requests run"
                       if spec.disable_by_batch_size else "")

    def _routes(self) -> str:
        parts = []
        if self.fused_decode_max_tokens:
            if self.large_steps == LargeSteps.QUANTIZED:
                parts.append("one native call")
            else:
                parts.append(f"one native call ({self.large_step_products()} past {self.fused_decode_max_tokens} "
                             "tokens)")
        if self.cuda_graph_max_tokens:
            parts.append(f"CUDA graphs up to {self.cuda_graph_max_tokens} tokens")
        if self.compile == CompileMode.GRAPH:
            parts.append("a compiled graph" + (" above" if parts else ""))
        elif self.compile == CompileMode.LAYERS:
            parts.append("compiled layers, attention eager")
        parts.append("eager with prompt tokens" if parts else "eager")
        return "; ".join(parts)


# The ways a step can run, in the order they are tried, each with when it can (the plan, whether the step is
# decode-only, its tokens, whether a compiled decode graph was built). A new route is a `StepRoute`, a line here and
# its runner in engine/model_runner.py.
STEP_ROUTES: tuple[tuple[StepRoute, Callable[[BuildPlan, bool, int, bool], bool]], ...] = (
    (StepRoute.FUSED, lambda plan, decode_only, tokens, graph: decode_only and plan.fused_decode_max_tokens > 0),
    (StepRoute.CUDA_GRAPH,
     lambda plan, decode_only, tokens, graph: decode_only and tokens <= plan.cuda_graph_max_tokens),
    (StepRoute.GRAPH, lambda plan, decode_only, tokens, graph: decode_only and graph),
    (StepRoute.EAGER, lambda plan, decode_only, tokens, graph: True),
)


def resolve_plan(config: EngineConfig, model: ModelConfig, source_formats: dict[str, str] | None = None) -> BuildPlan:
    """The plan for this config, model and host: each concern resolved in turn by its own function below (device
    and dtype, kernels, attention, weights, their products, elementwise ops, the decode route, the KV cache), each
    recording its reason. `source_formats`: how the checkpoint stored each tensor (a GGUF's GGML types), for the
    automatic choice of weights. Raises ValueError (or RuntimeError, for kernels asked for by name that cannot run
    here) before anything is built."""
    mc = config.model
    reasons: dict[str, str] = {}
    device = _device(config, reasons)
    on_cpu = device.startswith("cpu")
    dtype = _dtype(mc.dtype, device, reasons)
    # native kernels: CPU only; "torch" never; "native" wherever asked (an error where they cannot run)
    wanted = on_cpu and mc.kernels != "torch"
    built = wanted and load_cpu_kernels()
    if mc.kernels == "native" and not built:
        raise RuntimeError("kernels='native' but llmserve's native CPU kernels cannot run here (see the log)")

    attention = choose_attention(device, built, reasons)
    _check_family(config, model)
    weights = _weights(mc.quantization, source_formats, on_cpu, reasons)
    tp = config.parallel.tensor_parallel_size
    if config.parallel.world_size > 1:
        _check_parallel(config, model, weights, reasons)
    pp = config.parallel.pipeline_parallel_size
    stages = tuple(stage_layers(model, pp)) if pp > 1 else ()
    head = "int8"
    if mc.draft and mc.quantization == "auto" and built and native_quantized_kernels():
        weights = head = "int4"  # on PyTorch's int4 kernel a step would cost more than the target's
        reasons["weights"] = ("auto: a speculative draft, whose weights decide which tokens are proposed, never "
                              "which are kept: the fastest, output head included")
    products = _products(config, weights, on_cpu, built, wanted, reasons)
    huge_pages = _huge_pages(mc.huge_pages, products.small == Kernels.NATIVE, reasons)
    elementwise = _elementwise(mc.kernels, built, dtype, weights, products.large == LargeSteps.INT8, reasons)
    route = _decode_route(config, model, device, weights, products, elementwise, attention, reasons)
    max_model_len = min(mc.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    spec, num_blocks = _kv_cache(config, model, attention, dtype, max_model_len, device, reasons)
    batch_invariant = _batch_invariant(products, attention, reasons)
    return BuildPlan(
        device=device, dtype=dtype, weights=weights, small_step_kernels=products.small,
        small_step_max_tokens=products.small_max, large_steps=products.large,
        int8_products=products.int8_products, attention=attention, elementwise=elementwise,
        argmax=Kernels.NATIVE if built else Kernels.TORCH, compile=route.compile,
        fused_decode_max_tokens=route.fused_max_tokens,
        kv_cache=spec, num_kv_blocks=num_blocks, max_model_len=max_model_len, head=head, tensor_parallel_size=tp,
        pipeline_stages=stages,
        activation_parts=products.activation_parts, speculative=route.speculative,
        cuda_graph_max_tokens=route.cuda_graph_max_tokens, huge_pages=huge_pages, batch_invariant=batch_invariant,
        reasons=reasons,
    )


@dataclass(frozen=True)
class _Products:
    """How quantized linears multiply: the small-step kernels and their crossover, the int4 inputs' parts (1: Q8_0),
    and how large steps multiply (int8 x int8: on which kernel). Dense weights: the defaults."""

    small: Kernels = Kernels.NONE
    small_max: int = 0
    activation_parts: int = 2
    large: LargeSteps = LargeSteps.DENSE
    int8_products: Int8Products = Int8Products.NONE


def _products(config: EngineConfig, weights: str, on_cpu: bool, built: bool, wanted: bool,
              reasons: dict[str, str]) -> _Products:
    mc = config.model
    if mc.q8_activations and weights not in ("int4", "int4+int8"):
        raise ValueError(f"q8_activations are the int4 kernel's inputs, and this model's weights run "
                         f"{weights!r} ({reasons.get('weights', 'as asked')})")
    if mc.large_steps != "auto" and weights == "as loaded":
        raise ValueError(f"large_steps={mc.large_steps!r} needs quantized weights, and quantization="
                         f"{mc.quantization!r} keeps this model's as loaded ({reasons.get('weights', 'as asked')}): "
                         "ask for 'int8' or 'int4'")
    if mc.large_steps == "int8" and on_cpu and not cpu_has_vnni():
        raise ValueError("large_steps='int8' needs a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX): without it "
                         "oneDNN's int8 products saturate and give wrong results")
    if weights == "as loaded":
        return _Products()
    vectorized = built and native_quantized_kernels()
    if mc.kernels == "native" and not vectorized:
        raise RuntimeError("kernels='native' but the native quantized kernels need AVX-512 VNNI or AVX2")
    small = Kernels.NATIVE if vectorized else Kernels.TORCH
    if built and not vectorized:
        reasons["small steps"] = "llmserve's need AVX-512 VNNI or AVX2"
    if mc.large_steps == "quantized" and small != Kernels.NATIVE:
        raise ValueError("large_steps='quantized' needs llmserve's native quantized kernels (AVX-512 VNNI or AVX2)")
    small_max = small_step_tokens(weights)
    if mc.q8_activations and small != Kernels.NATIVE:
        raise ValueError("q8_activations need llmserve's native int4 kernel (AVX-512 VNNI or AVX2)")
    if weights == "int4+int8":  # with ~16-bit inputs (Q8_0's below)
        reasons["small steps"] = f"int8 layers up to {LINEAR_METHODS['int8'].small_step_tokens} tokens"
    q8 = mc.q8_activations
    if q8 is None:  # auto: where `llmserve eval` measured them to leave the model's quality as it was
        q8 = mc.quantization == "auto" and small == Kernels.NATIVE and (weights == "int4+int8" or mc.draft)
    large = _large_steps(config, weights, small, bool(q8), small_max, reasons)
    parts = 2
    if q8:
        parts = 1
        if large != LargeSteps.INT8:  # the int4 layers take steps up to Q8_MAX_TOKENS; the large-step product beyond
            small_max = Q8_MAX_TOKENS
        why = ("as asked" if mc.q8_activations else "auto: a draft's weights only propose" if mc.draft else
               f"auto: a K-quant mix, {_Q8_MEASURED}")
        reasons["small steps"] = "; ".join(filter(None, [
            why, f"{'int4 and int8' if weights == 'int4+int8' else 'int4'} layers up to {small_max} tokens, "
            "their inputs as Q8_0: half the integer work"]))
    elif mc.q8_activations is None and small == Kernels.NATIVE and weights == "int4":
        reasons["small steps"] = f"auto: ~16-bit int4 inputs for a 4-bit file, {_Q8_MEASURED}"
    products = Int8Products.NONE
    if large == LargeSteps.INT8:
        products = Int8Products.AMX if wanted and amx_int8_gemm() else Int8Products.ONEDNN
        if products == Int8Products.AMX:
            small_max = min(small_max, AMX_MIN_TOKENS - 1)
            amx_note = f"AMX takes steps from {AMX_MIN_TOKENS} tokens"
            reasons["large steps"] = "; ".join(filter(None, [reasons.get("large steps"), amx_note]))
    return _Products(small, small_max, parts, large, products)


def _large_steps(config: EngineConfig, weights: str, small: Kernels, q8: bool, small_max: int,
                 reasons: dict[str, str]) -> LargeSteps:
    """auto: the small-step kernels at every size where their inputs are Q8_0 (K-quant mixes, drafts): there they
    are faster than dense products from 32 to 512 tokens, keep one copy of the weights and make a token's bits
    independent of its step. With ~16-bit inputs (a 4-bit-only file, a Q8_0 file) their double integer work costs
    large steps 1.4-1.9x, served c=32 0.77-0.98x: there int8 x int8 for a 4-bit file on a CPU with VNNI, else dense,
    and `--large-steps quantized` is the deterministic choice (docs/performance.md, "Large steps on the quantized
    kernels")."""
    mc = config.model
    if mc.large_steps != "auto":
        reasons["large steps"] = "as asked"
        return LargeSteps(mc.large_steps)
    if small == Kernels.NATIVE and q8:
        reasons["large steps"] = f"auto: {_QUANTIZED_LARGE_STEPS}"
        return LargeSteps.QUANTIZED
    # not for int4+int8: on a K-quant mix int8 activations cost far more perplexity than its weights alone do
    if not (mc.quantization == "auto" and weights == "int4" and cpu_has_vnni()):
        if weights == "int4+int8":
            reasons["large steps"] = "auto: int8 activations cost this kind of file +1.8 % perplexity"
        return LargeSteps.DENSE
    if config.parallel.world_size > 1:
        reasons["large steps"] = "auto: parallel ranks (the calibration runs in one process)"
        return LargeSteps.DENSE
    if config.scheduler.max_num_batched_tokens <= small_max:
        # no step is ever large (and calibration, seeing none, would have nothing to measure)
        reasons["large steps"] = "auto: max_num_batched_tokens leaves every step to the small-step kernels"
        return LargeSteps.DENSE
    reasons["large steps"] = ("auto: a 4-bit file, and this CPU multiplies int8 natively; +0.2-0.3 % perplexity on "
                              "SmolLM2 (docs/performance.md, \"Large steps: int8 activations and dense products\"); "
                              "--large-steps quantized: deterministic, a third less memory, c=32 0.77-0.98x")
    return LargeSteps.INT8


def _batch_invariant(products: _Products, attention: str, reasons: dict[str, str]) -> bool:
    """Whether a token's output has the same bits whatever else its step holds (other requests, its prompt's chunks
    or cached blocks, a speculative verification, a recomputation after preemption): where every product is the
    quantized kernels' (their integer sums are exact, the rest per row) and attention the native decode kernel's,
    prompt tokens as decode rows (its context split depends on the row alone)."""
    if products.large == LargeSteps.QUANTIZED and attention == "native":
        reasons["determinism"] = ("quantized products at every size, attention on the decode kernel for prompt "
                                  "tokens too")
        return True
    why = ("dense or int8 x int8 large steps round by the step's size" if products.large != LargeSteps.QUANTIZED
           else "PyTorch attention blocks a prompt by its length")
    reasons["determinism"] = why
    return False


def _elementwise(kernels: str, built: bool, dtype: torch.dtype, weights: str, int8_activations: bool,
                 reasons: dict[str, str]) -> Kernels:
    """The layers' norms, rotary and gate in eager steps. In float32 (the dtype held to transformers' rounding) the
    kernels sum RMSNorm's squares in another order, and a last-bit difference can move an int8 activation's level:
    there, only when asked for by name, or under int4 weights without int8 activations (the int4 kernel splits an
    activation into ~16 bits, so a last bit moves it by 1/508 of a level, never a whole one), where they open the
    one-call decode stack, which a float32 host needs most (docs/performance.md, "The one-call decode step")."""
    elementwise = Kernels.NATIVE if built and (dtype == torch.bfloat16 or kernels == "native" or (
        weights == "int4" and not int8_activations)) else Kernels.TORCH
    if built and elementwise == Kernels.TORCH:
        reasons["elementwise"] = "the native ones are used in bfloat16, under int4 weights, or with kernels='native'"
    return elementwise


@dataclass(frozen=True)
class _DecodeRoute:
    """How decode steps run: compiled ("graph", "layers") or not, as one native call up to `fused_max_tokens`,
    replayed CUDA graphs up to `cuda_graph_max_tokens`, and speculation."""

    compile: CompileMode
    fused_max_tokens: int
    speculative: SpeculativeConfig | None
    cuda_graph_max_tokens: int


def _decode_route(config: EngineConfig, model: ModelConfig, device: str, weights: str, products: _Products,
                  elementwise: Kernels, attention: str, reasons: dict[str, str]) -> _DecodeRoute:
    mc = config.model
    ranks = config.parallel.world_size
    compile_mode = CompileMode.OFF
    if mc.compile and ranks > 1:
        reasons["decode steps"] = "parallel: eager (compiled graphs would hold the collectives)"
    elif mc.compile and model.moe is not None:
        reasons["decode steps"] = "experts: eager (which experts run, and on how many rows, is known only at run time)"
    elif mc.compile:
        compile_mode = CompileMode.GRAPH if attention == "native" else CompileMode.LAYERS
    # every family's layers (experts too) and int8 linears (a K-quant mix's) run inside the one call, which takes
    # steps as large as every method's small-step kernel does (int8's: 8 tokens with ~16-bit inputs, int4's with
    # Q8_0 ones)
    fused = (ranks == 1 and weights != "as loaded" and products.small == Kernels.NATIVE
             and elementwise == Kernels.NATIVE and attention == "native"
             and all(int4_packs(*shape) for shape in _linear_shapes(model)))
    if fused and not all(LINEAR_METHODS[m].in_one_call for m in methods_of(weights)):  # layer by layer
        fused = False
        reasons["decode steps"] = f"{weights} layers run layer by layer (the one native call holds int4 and int8)"
    fused_max = (min(small_step_cap(m, products.small_max, products.activation_parts) for m in methods_of(weights))
                 if fused else 0)
    # at every size: past the small-step kernels the call makes the layers' large-step products itself (int8 x int8,
    # or dense), as layer by layer a large step spends a good share of its time between the ops
    # (docs/performance.md, "The one-call decode step")
    if fused:
        reasons["decode steps"] = "native quantized products, attention and elementwise ops: one call for all layers"
    if fused and compile_mode != CompileMode.OFF:
        compile_mode = CompileMode.OFF
        reasons["decode steps"] += "; every decode step runs as one call: nothing is left for --compile to compile"

    speculative = _speculation(config.speculative, fused, mc.model, reasons)
    cuda_graphs = 0
    if device.startswith("cuda") and mc.enforce_eager:
        reasons["decode steps"] = "enforce_eager"
    elif device.startswith("cuda") and ranks == 1 and compile_mode == CompileMode.OFF:
        cuda_graphs = min(MAX_GRAPH_BATCH, config.scheduler.max_num_seqs * (
            1 + (speculative.num_speculative_tokens if speculative else 0)))
        reasons["decode steps"] = ("CUDA: each batch and context size class captured at its first step, then "
                                   "replayed (one launch instead of ~60 a layer)")
    return _DecodeRoute(compile_mode, fused_max, speculative, cuda_graphs)


def _kv_cache(config: EngineConfig, model: ModelConfig, attention: str, dtype: torch.dtype, max_model_len: int,
              device: str, reasons: dict[str, str]) -> tuple[KVCacheSpec, int]:
    """The attention backend's cache layout and how many blocks of it fit."""
    backend = ATTENTION_BACKENDS[attention]()
    spec = backend.kv_cache_spec(model.num_layers, model.num_kv_heads, model.head_dim, config.cache.block_size, dtype,
                                 config.cache.kv_cache_dtype)
    num_blocks = _num_kv_blocks(config, spec, max_model_len, device, reasons)
    if spec.dtype != dtype:  # quantized: say what it buys against the model dtype's cache
        full = backend.kv_cache_spec(model.num_layers, model.num_kv_heads, model.head_dim, config.cache.block_size,
                                     dtype)
        reasons["KV cache"] += (f"; {config.cache.kv_cache_dtype}: {full.bytes_per_block / spec.bytes_per_block:.2f}x "
                                f"the tokens of a {str(dtype).removeprefix('torch.')} cache")
    return spec, num_blocks


def _speculation(asked: SpeculativeConfig | str | None, fused: bool, model: str | None,
                 reasons: dict[str, str]) -> SpeculativeConfig | None:
    """Speculative decoding as asked, or, for "auto", at low load where the one native call runs the decoder (see
    AUTO_SPECULATION_BELOW): a draft model, one request at a time, where the model has one registered and installed
    (see AUTO_DRAFT_BELOW), else n-gram prompt lookup; elsewhere none."""
    if asked != "auto":
        return asked
    if not fused:
        reasons["speculation"] = ("auto: off, steps run layer by layer or compiled, where each proposal token "
                                  "costs more (--speculative-config to ask for it)")
        return None
    why = ("auto: a step of a few tokens streams the weights once, like a step of one; seeded requests that sample "
           "never speculate; --speculative-config off to disable")
    draft, installed = registered_draft(model)
    if installed:
        reasons["speculation"] = f"{why}; a draft model: {AUTO_DRAFT_MEASURED}"
        return SpeculativeConfig(method="draft_model", model=draft, disable_by_batch_size=AUTO_DRAFT_BELOW,
                                 automatic=True)
    reasons["speculation"] = why + (f"; `llmserve download {draft}` for a draft model ({AUTO_DRAFT_MEASURED})"
                                    if draft else "")
    return SpeculativeConfig(method="ngram", disable_by_batch_size=AUTO_SPECULATION_BELOW, automatic=True)


def _check_family(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError for a calibration this model's layers do not have: AWQ searches dense feed-forward layers (the
    calibrations run the serving forward, so every dense family's norms and windows are searched as served)."""
    if config.model.quantization == "awq" and model.moe is not None:
        raise ValueError(f"quantization='awq' searches dense layers, and {model.architecture} has experts: "
                         "use 'auto', 'int4' or 'int8'")


def _check_parallel(config: EngineConfig, model: ModelConfig, weights: str, reasons: dict[str, str]) -> None:
    """ValueError for what a parallel group cannot run: a model whose heads or MLP do not split over the tensor-
    parallel ranks, or whose layers are fewer than the stages; AWQ searched at start (each rank would search its
    own), int8 activations (calibrated in one process)."""
    parallel = config.parallel
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    check_shardable(model, tp, weights)
    stage_layers(model, pp)
    asked = " and ".join(f"{name}={n}" for name, n in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp))
                         if n > 1)
    if config.model.quantization == "awq":
        raise ValueError(f"{asked} with quantization='awq': search once with `llmserve quantize "
                         "MODEL --method awq --out DIR` and serve DIR")
    if config.model.large_steps == "int8":
        raise ValueError(f"int8 large steps are calibrated in one process: not with {asked}")
    if tp > 1:
        reasons["tensor parallel"] = ("each rank its heads, MLP units and vocabulary rows; two all-reduces a layer, "
                                      "the decoder stack layer by layer")
    if pp > 1:
        reasons["pipeline parallel"] = ("balanced by the weights each stage reads, the output head counted on the "
                                        "last; a step's requests cut into a micro-batch a stage")


# Why the quantized kernels take large steps by default (docs/performance.md, "Large steps")
_QUANTIZED_LARGE_STEPS = ("Q8_0 inputs: the small-step kernels at every size, faster than dense products, no second "
                          "copy of the weights, and a token's product the same bits whatever else its step holds")

# What Q8_0 inputs to the int4 kernel (llama.cpp's activations) cost, by `llmserve eval`'s perplexity with every
# token through the kernel (docs/performance.md, "Weight quantization quality"): little on the Qwen2.5-Coder Q4_K_M
# files, more on SmolLM2's Q4_1, whose q/k/v and gate/up inputs carry a few channels far larger than the rest (a
# group of 32 that holds one rounds its other 31 coarsely).
_Q8_MEASURED = "Q8_0 inputs cost Qwen2.5-Coder-1.5B's Q4_K_M +0.03 % perplexity, SmolLM2's Q4_1 +1.45 %"

# GGML types with more than 4 bits a weight that int8 stands in for per output channel beside int4 in a K-quant mix
# (each value changed by at most half an int8 step of its row); those int8 holds exactly are its `file_types`
_WIDER_PER_CHANNEL = {"Q5_1", "Q5_K"}
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _weights(choice: str | None, formats: dict[str, str] | None, on_cpu: bool, reasons: dict[str, str]) -> str:
    """"as loaded", a registered format (quantization/methods/) or a mix of them. auto: the first format whose
    `file_types` hold every one of the file's decoder weights, so the layers compute with the values shipped (int4 on
    a 4-bit file, as llama.cpp does, activations quantized to 8 bits in the small steps; int8 on Q6_K, Q8_0, Q5_0 or
    its own per-channel files). A K-quant mix (mostly 4-bit, some tensors in 5-8 bits, as Q4_K_M files are) runs int4
    on the 4-bit tensors and int8 on the others ("int4+int8"): Q6_K, Q8_0 and Q5_0 ones at the file's own values
    (`Checkpoint.int8_grids`), the rest per channel, each value changed by at most half an int8 step of its row
    (docs/performance.md, "Weight quantization quality"), which only a mostly 4-bit file takes. Any other file keeps
    its weights as loaded (int4 would change them: measure its cost with `llmserve eval` first)."""
    if choice in LINEAR_METHODS or choice in MIXED_METHODS:
        reasons["weights"] = "as asked"
        return choice
    if choice == "awq":  # the checkpoint's weights are on AWQ's groups by now (quantize_checkpoint)
        reasons["weights"] = "awq: int4 on activation-aware scales and groups"
        return "int4"
    if choice != "auto":
        return "as loaded"
    linear = [fmt for name, fmt in (formats or {}).items()
              if name.endswith(".weight") and any(f".{p}." in name for p in _DECODER_LINEARS)]
    stored = set(linear)
    for spec in LINEAR_METHODS.values() if on_cpu and stored else ():
        if stored <= spec.file_types:
            reasons["weights"] = (f"auto: the file's linear weights are {'/'.join(sorted(stored))}, on a grid "
                                  f"{spec.name} holds (the file's values)")
            return spec.name
    four_bit_types, wider_types = (LINEAR_METHODS[m].file_types for m in MIXED_METHODS["int4+int8"])
    four_bit = sum(fmt in four_bit_types for fmt in linear)
    exact = stored <= four_bit_types | wider_types  # every value kept: int4 or int8 on the file's own grids
    if (on_cpu and stored and stored <= four_bit_types | wider_types | _WIDER_PER_CHANNEL
            and (exact or 2 * four_bit >= len(linear))):
        on_grid, per_channel = sorted(stored & wider_types), sorted(stored & _WIDER_PER_CHANNEL)
        how = "; ".join([f"{'/'.join(on_grid)} at the file's values"] * bool(on_grid) +
                        [f"{'/'.join(per_channel)} per channel"] * bool(per_channel))
        reasons["weights"] = (f"auto: {four_bit} of the file's {len(linear)} linear weights are 4-bit "
                              f"({'/'.join(sorted(stored & four_bit_types))}: int4 on their grid), the others int8 "
                              f"({how})")
        return "int4+int8"
    reasons["weights"] = ("auto: " + (f"the file's linear weights are {'/'.join(sorted(stored))}, which int4 would "
                          "change" if stored else "a dense file") if on_cpu else "auto: quantization is CPU-only")
    return "as loaded"


# What a huge-page arena buys the one-token steps that stream every weight (quantization/weight_arena.py;
# docs/performance.md, "Quantized weight kernels").
_HUGE_PAGES_MEASURED = "one-token steps 3-7 % faster on a Zen 5 host, SmolLM2 and Qwen2.5-Coder-1.5B alike"


def _huge_pages(asked: bool | None, native_quantized: bool, reasons: dict[str, str]) -> bool:
    """Whether the weights a decode step streams go into one huge-page arena: where they are quantized on the
    native kernels (their packed tensors are what a step reads) and the host gives huge pages on request."""
    if not native_quantized:
        if asked:
            raise ValueError("huge_pages places quantized weights on the native kernels, and this model has none")
        return False
    if asked is False:
        reasons["weight memory"] = "as asked"
        return False
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        if asked:
            raise ValueError(f"huge_pages needs Linux's transparent huge pages, and they are {mode or 'absent'} here "
                             "(/sys/kernel/mm/transparent_hugepage/enabled)")
        reasons["weight memory"] = f"auto: transparent huge pages are {mode or 'absent'} on this host"
        return False
    reasons["weight memory"] = "as asked" if asked else f"auto: each step streams the weights; {_HUGE_PAGES_MEASURED}"
    return True


def _device(config: EngineConfig, reasons: dict[str, str]) -> str:
    """auto: a CUDA GPU (one a rank) unless something asked for runs on the CPU only: decode steps replayed
    as CUDA graphs serve far more than a CPU does (docs/performance.md, "CUDA")."""
    mc = config.model
    if mc.device != "auto":
        return mc.device
    cpu_only = [what for what, asked in ((f"quantization {mc.quantization!r}", mc.quantization in QUANTIZATION_METHODS),
                                         ("kernels 'native'", mc.kernels == "native"),
                                         (f"large_steps {mc.large_steps!r}", mc.large_steps in ("int8", "quantized"))
                                         ) if asked]
    ranks = config.parallel.world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        reasons["device"] = "auto: no CUDA GPU"
    elif cpu_only:
        reasons["device"] = f"auto: {' and '.join(cpu_only)} run on the CPU only"
    elif gpus < ranks:
        reasons["device"] = f"auto: {ranks} parallel ranks, {gpus} CUDA GPU(s)"
    else:
        reasons["device"] = f"auto: {torch.cuda.get_device_name()}"
        return "cuda"
    return "cpu"


def _dtype(name: str, device: str, reasons: dict[str, str]) -> torch.dtype:
    if name != "auto":
        reasons["dtype"] = "as asked"
        return getattr(torch, name)
    if device.startswith("cuda"):
        reasons["dtype"] = "auto: CUDA"
        return torch.bfloat16
    if cpu_has_native_bf16():
        reasons["dtype"] = "auto: this CPU multiplies bfloat16 natively"
        return torch.bfloat16
    reasons["dtype"] = "auto: no native bfloat16 on this CPU"
    return torch.float32


def _num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, max_model_len: int, device: str,
                   reasons: dict[str, str]) -> int:
    cache = config.cache
    if cache.kv_cache_memory_gb is not None:
        budget = cache.kv_cache_memory_gb * 2**30
        reasons["KV cache"] = "kv_cache_memory_gb"
    elif device.startswith("cuda"):  # the cache lives in the GPU's memory, not the host's
        budget = cache.kv_cache_memory_fraction * torch.cuda.mem_get_info(torch.device(device))[0]
        reasons["KV cache"] = f"{cache.kv_cache_memory_fraction:.0%} of the GPU memory free at start"
    else:
        budget = cache.kv_cache_memory_fraction * psutil.virtual_memory().available
        reasons["KV cache"] = f"{cache.kv_cache_memory_fraction:.0%} of the memory available at start"
    # never more than every sequence at full length could use
    ceiling = -(-config.scheduler.max_num_seqs * max_model_len // spec.block_size)
    blocks = min(int(budget // spec.bytes_per_block), ceiling)
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget / 2**30:.4f} GiB holds not even one block")
    return blocks


def _linear_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of the decoder layers' fused linears: q/k/v, o, and each gated MLP's gate/up and down (the dense
    one's, an expert's, a shared expert's)."""
    q, kv, hidden = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.hidden_size
    mlps = [model.intermediate_size]
    if model.moe is not None:
        mlps += [model.moe.expert_intermediate_size, model.moe.shared_expert_intermediate_size]
    return [(q + 2 * kv, hidden), (hidden, q)] + [shape for size in mlps if size
                                                  for shape in ((2 * size, hidden), (hidden, size))]
