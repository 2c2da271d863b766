"""The synchronous engine: requests in, one `step()` at a time, incremental outputs out.

step() = schedule ▶ execute (one forward pass + sampling) ▶ update (append tokens, stop checks,
free finished requests' blocks) ▶ outputs. Everything a request can be refused for is checked in
`add_request`, before it takes any resource.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psutil
import torch

from llmserve.config import EngineConfig, resolve_dtype
from llmserve.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from llmserve.engine.model_runner import ModelRunner
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.kernels import amx_int8_gemm, load_cpu_kernels, native_quantized_kernels
from llmserve.kv_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from llmserve.layers.linear import prepack_linears
from llmserve.layers.sampler import SampledToken
from llmserve.loader import build_model, load_checkpoint
from llmserve.models.llama import compile_layers, use_fused_decode, use_native_elementwise
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.quantization.int8_activations import calibration_prompts, record_input_ranges
from llmserve.quantization.weight_only import WeightOnlyLinear, quantize_model
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        torch.manual_seed(mc.seed)
        ckpt = load_checkpoint(mc.model)
        self.model_name = ckpt.name
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.chat_template = ckpt.chat_template
        self.eos_token_ids = ckpt.eos_token_ids or [ckpt.tokenizer.eos_token_id]
        self.dtype = resolve_dtype(mc.dtype, mc.device)
        logger.info("dtype %s (%s)", self.dtype, "chosen automatically" if mc.dtype == "auto" else "as asked")
        model = build_model(ckpt, self.dtype, mc.device)
        del ckpt
        if mc.quantization:
            quantize_model(model, mc.quantization, native_kernels=self._native_quantized_kernels())
            logger.info("weights quantized: %s (linear layers), int8 output head", mc.quantization)
        if packed := prepack_linears(model):
            logger.info("%d linear weights prepacked for oneDNN", packed)
        native_elementwise = self._native_elementwise()
        if native_elementwise:
            use_native_elementwise(model)
        self.max_model_len = min(mc.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        block_size = config.cache.block_size
        num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        native = self._native_attention()
        if mc.compile and not native:
            compile_layers(model)  # the PyTorch attention path: per layer, attention left eager
        self.runner = ModelRunner(
            model, self.model_config, num_blocks, block_size, self.dtype, mc.device, native,
            compile_decode=mc.compile and native, native_argmax=self._native_argmax(),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.requests: dict[str, Request] = {}
        self._backend_tokenizer = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer._tokenizer
        self.token_bytes = TokenBytes(self._backend_tokenizer)  # for logprobs' `bytes`
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); max_model_len %d",
            num_blocks, block_size, num_blocks * block_size, self.kv_cache_bytes / 2**30, self.max_model_len,
        )
        if mc.int8_activations:
            self._calibrate_int8_activations()  # may lower the token count the int4 kernel takes
        if native_elementwise and native and (limit := use_fused_decode(model, self.runner.kv_caches)):
            logger.info("decode steps of up to %d tokens: the decoder layers as one native call", limit)
        if mc.compile:
            self._warm_up()

    def _native_attention(self) -> bool:
        """Whether decodes use the native kernel: asked for, or "auto" on CPU where it builds."""
        return self._use_native("attention_backend", load_cpu_kernels, "decode attention", "could not be built")

    def _native_quantized_kernels(self) -> bool:
        """Whether small quantized steps use the native kernels: asked for, or "auto" where they build
        vectorized (they need AVX-512 VNNI)."""
        return self._use_native("quantized_kernels", native_quantized_kernels, "quantized steps of few tokens",
                                "are not built vectorized here (they need AVX-512 VNNI)")

    def _native_elementwise(self) -> bool:
        """Whether eager steps run the layers' norms, rotary and gate on the native kernels: asked for
        (float32 or bfloat16), or "auto" in bfloat16 on CPU where they build.

        Not "auto" in float32, the dtype we check against transformers to its rounding: the kernels sum
        RMSNorm's squares in another order, and with int8 activations a last-bit difference can move a
        value across a quantization level (a test's greedy tokens then diverged at a 1.8 % logit gap).
        In bfloat16 eager PyTorch rounds after every op; the kernels round once, as compiled code does."""
        dtypes = (torch.float32, torch.bfloat16) if self.config.model.elementwise_kernels == "native" else (
            torch.bfloat16,)

        def available() -> bool:
            return self.dtype in dtypes and load_cpu_kernels()
        return self._use_native("elementwise_kernels", available, "norms, rotary and gate of eager steps",
                                "could not be built or do not take this dtype")

    def _native_argmax(self) -> bool:
        """Greedy sampling's argmax on the native kernel (exact in any dtype: logits are float32) unless
        elementwise_kernels is "torch"."""
        mc = self.config.model
        return mc.elementwise_kernels != "torch" and mc.device.startswith("cpu") and load_cpu_kernels()

    def _amx_int8_products(self) -> bool:
        """Whether int8 x int8 products run on our AMX kernel: native quantized kernels not refused, and AMX
        built and granted here (elsewhere they stay on oneDNN, which is what "native" cannot change)."""
        mc = self.config.model
        usable = mc.quantized_kernels != "torch" and mc.device.startswith("cpu") and amx_int8_gemm()
        logger.info("int8 x int8 products: %s", "native AMX kernel" if usable else "oneDNN")
        return usable

    def _use_native(self, option: str, available: Callable[[], bool], what: str, why_not: str) -> bool:
        """A KERNEL_CHOICES option: "torch" never, "native" always (raises where it can't), "auto" where
        `available()`; native kernels are CPU-only."""
        choice = getattr(self.config.model, option)
        if choice == "torch" or not self.config.model.device.startswith("cpu"):
            return False
        if available():
            logger.info("%s: native CPU kernels", what)
            return True
        if choice == "native":
            raise RuntimeError(f"{option}='native' but the native kernels {why_not} (see the log)")
        return False

    # --- public API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        max_tokens = self._check_request(token_ids, params)
        detok = IncrementalDetokenizer(
            self._backend_tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        req = Request(request_id, text, token_ids, params, max_tokens, self.eos_token_ids, detok, cache_salt)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; returns its last output, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.detokenizer.finish()
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; outputs of every request that produced a token or finished."""
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        sampled, failed = self._execute(scheduled.scheduled)
        outputs = [self._fail(req, error) for req, error in failed]
        for (req, n), token in zip(scheduled.scheduled, sampled, strict=True):
            if req.request_id not in self.requests:
                continue  # failed above
            req.num_computed_tokens += n
            self.kv_cache.cache_blocks(
                req.request_id, req.all_token_ids, req.block_hashes, req.num_computed_tokens, req.cache_salt
            )
            if token is None:
                continue  # a prompt chunk that is not the last
            try:
                req.append_token(token.token_id)
                if req.logprobs is not None:
                    self._record_logprobs(req, token)
            except Exception as e:  # one request's failure (e.g. detokenizing) is not the batch's
                logger.exception("request %s failed", req.request_id)
                outputs.append(self._fail(req, e))
                continue
            if req.status.finished:
                self.scheduler.finish(req, req.status)
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _execute(
        self, entries: list[tuple[Request, int]]
    ) -> tuple[list[SampledToken | None], list[tuple[Request, Exception]]]:
        """Run a step; when it raises, run its halves apart, recursively, until each failure is pinned
        on one request. One request's input (or a kernel bug only it reaches) then fails that request
        alone, for a few extra forward passes, and the others' tokens are what a clean step gives:
        re-running a step rewrites the same K/V slots. Returns the tokens (None for a failed entry) and
        the failed requests with their errors."""
        try:
            return self.runner.execute(entries, self.kv_cache), []
        except Exception as e:
            if len(entries) == 1:
                logger.error("request %s failed in the engine step", entries[0][0].request_id, exc_info=e)
                return [None], [(entries[0][0], e)]
            logger.warning("an engine step of %d requests failed (%s: %s); running its halves apart to find "
                           "the request(s) that fail it", len(entries), type(e).__name__, e)
        mid = len(entries) // 2
        left, left_failed = self._execute(entries[:mid])
        right, right_failed = self._execute(entries[mid:])
        return left + right, left_failed + right_failed

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """Abort a request that failed and return its last output, carrying the error."""
        out = self.abort_request(req.request_id)
        out.error = f"{type(error).__name__}: {error}"
        return out

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.num_blocks * self._block_bytes()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # --- internals --------------------------------------------------------------------------

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> int:
        """Everything a request is checked against the model for; returns its output budget."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one new token)"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        need = self.kv_cache.blocks_needed(n + max_tokens)
        if need > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt + max_tokens = {n + max_tokens} tokens need {need} KV blocks, but the whole cache "
                f"holds {self.kv_cache.num_blocks}; lower max_tokens or raise kv_cache_memory_gb"
            )
        return max_tokens

    def _block_bytes(self) -> int:
        return (
            self.config.cache.block_size * self.model_config.kv_bytes_per_token
            * torch.tensor([], dtype=self.dtype).element_size()
        )

    def _calibrate_int8_activations(self) -> None:
        """Measure each decoder linear's input range on the calibration prompts (run as requests, so
        through this engine's own forward pass), then switch those layers' large steps to int8 x int8."""
        start = time.perf_counter()
        layers = {name: m for name, m in self.runner.model.layers.named_modules() if isinstance(m, WeightOnlyLinear)}
        greedy = SamplingParams(temperature=0, max_tokens=1)
        with record_input_ranges(layers) as absmax:
            for i, text in enumerate(calibration_prompts()):
                prompt = self.apply_chat_template([{"role": "user", "content": text}]) if self.chat_template else text
                # salted: these blocks were computed before the switch, no request may reuse them
                self.add_request(f"calibration-{i}", prompt, greedy, cache_salt="int8-calibration")
            while self.has_unfinished_requests():
                self.step()
        amx = self._amx_int8_products()
        for name, layer in layers.items():
            layer.use_int8_activations(absmax[name], amx=amx)
        self.kv_cache.stats = PrefixCacheStats()
        logger.info("int8 activations: %d layers calibrated in %.1fs", len(layers), time.perf_counter() - start)

    def _warm_up(self) -> None:
        """Compile before serving: one step of each shape class the compiled code specialises on (one
        token, a few tokens, more tokens than a quantized kernel takes, alone and in decode batches of
        those sizes), so no request pays for it."""
        start = time.perf_counter()
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        wide = min(17, self.config.scheduler.max_num_seqs)  # past the quantized kernels' 8 and 16 tokens
        batches = ([list(range(100, 140))], [list(range(200, 240)), list(range(300, 303))],
                   [list(range(400 + i, 420 + i)) for i in range(wide)])
        for batch in batches:
            for i, prompt in enumerate(batch):
                self.add_request(f"warm-up-{len(batch)}-{i}", prompt, greedy)
            while self.has_unfinished_requests():
                self.step()
        self.kv_cache.stats = PrefixCacheStats()  # the warm-up is nobody's traffic
        if self.runner.decode_graph:
            self.runner.decode_graph.freeze()
        logger.info("compiled and warmed up in %.1fs", time.perf_counter() - start)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_gb is not None:
            budget = cache.kv_cache_memory_gb * 2**30
        else:
            budget = cache.kv_cache_memory_fraction * psutil.virtual_memory().available
        # never more than every sequence at full length could use
        ceiling = self.config.scheduler.max_num_seqs * self.max_model_len
        blocks = min(int(budget // self._block_bytes()), -(-ceiling // cache.block_size))
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget / 2**30:.4f} GiB holds not even one block")
        return blocks

    def _record_logprobs(self, req: Request, token) -> None:
        entry = {token.token_id: Logprob(token.logprob, token.rank, self.tokenizer.decode([token.token_id]))}
        for rank, (tid, lp) in enumerate(token.top or [], start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        req.logprobs.append(entry)
        req.cumulative_logprob += token.logprob

    def _output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=req.detokenizer.output_text,
            token_ids=req.output_token_ids,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        metrics = {"arrival_time": req.arrival_time, "num_preemptions": req.num_preemptions}
        for name in ("scheduled_time", "first_token_time"):
            if getattr(req, name) is not None:
                metrics[name] = getattr(req, name)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.status.finished,
            num_cached_tokens=req.num_cached_tokens or 0,
            metrics=metrics,
        )
