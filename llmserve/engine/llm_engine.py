"""The synchronous engine: requests in, one `step()` at a time, incremental outputs out.

step() = schedule (a `SchedulerOutput`) ▶ the runner runs it (a `ModelRunnerOutput`) ▶ the scheduler
applies it (computed counts, prefix-cache blocks, new tokens, stop checks, finished requests' blocks)
▶ each request's output delta. Everything a request can be refused for is checked in `add_request`
(by the input processor), before it takes any resource. Construction: the checkpoint, the build plan
(logged), the runner that builds the model from it, the KV manager and the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.config import EngineConfig
from llmserve.engine.build_plan import CompileMode, resolve_plan
from llmserve.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from llmserve.engine.heap import trim_heap
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.model_runner import ModelRunner, RunnerStoppedError
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import RequestUpdate, Scheduler
from llmserve.engine.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from llmserve.kv_cache.block_hash import BlockHash, extend_block_hashes
from llmserve.kv_cache.kv_cache_manager import KVCacheManager
from llmserve.kv_cache.kv_transfer import KVFormat, export_blocks, import_blocks
from llmserve.loader import load_checkpoint, load_tokenizer, same_tokenizer
from llmserve.loader.default_models import resolve_model_path
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.quantization.awq import AWQConfig
from llmserve.quantization.calibration_cache import calibration_key, load_ranges, save_ranges
from llmserve.quantization.int8_activations import calibration_prompts, record_input_ranges
from llmserve.quantization.quantize_checkpoint import SERVE_AWQ_GROUP_SIZE, quantize_checkpoint
from llmserve.quantization.weight_only import WeightOnlyLinear
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.draft_proposer import DraftModelProposer
from llmserve.spec_decode.speculator import SpecDecodeStats, Speculator
from llmserve.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from llguidance import LLMatcher

logger = logging.getLogger(__name__)
# A draft request is made anew each step over the request's tokens and catches up from its prefix cache,
# which holds whole blocks only: with blocks of 4 the catch-up (the last partial block + the tokens verified
# since) stays a small step, where blocks of 16 often made it a large, dense one.
DRAFT_BLOCK_SIZE = 4


@dataclass
class EngineStats:
    """What the engine can say about itself between steps (for /metrics and the stats log line)."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    num_cached_blocks: int  # blocks findable by hash (in use or free)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found there
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: proposals and kept tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: object | None = None) -> None:
        """`tokenizer`: one already read from the model's tokenizer files (a draft's: see `_speculator`)."""
        self.config = config
        torch.manual_seed(config.model.seed)
        ckpt = load_checkpoint(config.model.model, tokenizer)
        if config.model.quantization == "awq":  # scales searched and folded, weights on int4 groups
            ckpt, _ = quantize_checkpoint(ckpt, "awq", AWQConfig(group_size=SERVE_AWQ_GROUP_SIZE))
        self.model_name = ckpt.name
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.eos_token_ids = ckpt.eos_token_ids or [ckpt.tokenizer.eos_token_id]
        self.plan = resolve_plan(config, ckpt.config, ckpt.source_formats)
        spec = self.plan.speculative
        draft_kv_bytes = 0
        if spec is not None and spec.method == "draft_model":  # the draft's cache comes out of the same budget
            draft_blocks = int(self.plan.num_kv_blocks * spec.draft_kv_cache_fraction)
            draft_kv_bytes = draft_blocks * self.plan.kv_cache.bytes_per_block
            self.plan = dataclasses.replace(self.plan, num_kv_blocks=self.plan.num_kv_blocks - draft_blocks)
        logger.info(self.plan.describe())
        if config.parallel.world_size > 1:  # rank 0 here, the other ranks in worker processes
            from llmserve.distributed.executor import ParallelRunner

            self.runner = ParallelRunner(self.plan, ckpt, config)
        else:
            # a start after the first maps the model as an earlier one built it (quantization/prepared_cache.py)
            prepared = None if config.model.quantization == "awq" else calibration_key(
                resolve_model_path(config.model.model)[0], config, self.plan)
            self.runner = ModelRunner(self.plan, ckpt, prepared_key=prepared)
        block_size = self.plan.kv_cache.block_size
        self.processor = InputProcessor(ckpt.tokenizer, ckpt.chat_template, ckpt.config.vocab_size,
                                        self.plan.max_model_len, self.plan.num_kv_blocks * block_size)
        self.structured = StructuredOutputManager(ckpt.tokenizer, ckpt.config.vocab_size, self.eos_token_ids)
        del ckpt
        self.kv_cache = KVCacheManager(self.plan.num_kv_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.speculator = self._speculator(draft_kv_bytes) if spec else None
        self._backend_tokenizer = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer._tokenizer
        self.token_bytes = TokenBytes(self._backend_tokenizer)  # for logprobs' `bytes`
        if self.plan.int8_activations:
            self._calibrate_int8_activations()
        if self.plan.compile != CompileMode.OFF:
            self._warm_up()
        trim_heap()  # calibration's and warm-up's temporaries too (heap.py)

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    @property
    def chat_template(self) -> str | None:
        return self.processor.chat_template

    @property
    def requests(self) -> dict[str, Request]:
        """Requests not finished yet, by id."""
        return self.scheduler.requests

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.num_blocks * self.plan.kv_cache.bytes_per_block

    # --- public API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        req = self.new_request(request_id, prompt, params, cache_salt)
        self.scheduler.add_request(req)
        return req

    def new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A checked request, not yet queued (`scheduler.add_request` queues it). It reads only what never
        changes (the tokenizer, the length rule, the grammar compiler), so a server builds it on its event loop
        while a step runs, and hands it to the step loop."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = (prompt, self.processor.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        max_tokens = self.processor.check(token_ids, params)
        detok = IncrementalDetokenizer(
            self._backend_tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        req = Request(request_id, text, token_ids, params, max_tokens, self.eos_token_ids, detok, cache_salt)
        if params.structured_outputs is not None:
            req.grammar = self.structured.new_matcher(params.structured_outputs)
        return req

    # --- a prompt's KV blocks to or from another instance (kv_cache/kv_transfer.py) ------------------------------

    @property
    def kv_format(self) -> KVFormat:
        """What this instance's KV blocks are, for a receiver to check."""
        spec = self.plan.kv_cache
        return KVFormat(self.model_name, self.plan.weights, str(spec.dtype).removeprefix("torch."), spec.block_size,
                        spec.num_layers, spec.num_kv_heads, spec.row_width)

    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The hashes of the prompt's full blocks that a prefix hit can cover (all but the last token's)."""
        bs = self.plan.kv_cache.block_size
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids[: (len(token_ids) - 1) // bs * bs], bs, cache_salt)
        return hashes

    def export_kv(self, block_hashes: list[BlockHash], token_ids: list[int]) -> tuple[int, bytes]:
        """The leading run of these blocks this instance holds, and their bytes. Between steps only."""
        return export_blocks(self.kv_cache.pool, self._local_caches(), block_hashes, token_ids,
                             self.plan.kv_cache.block_size)

    def import_kv(self, sent: KVFormat, count: int, payload: bytes, block_hashes: list[BlockHash],
                  token_ids: list[int]) -> int:
        """Another instance's blocks into the prefix cache; how many were written. Between steps only."""
        return import_blocks(self.kv_cache.pool, self._local_caches(), self.kv_format, sent, count, payload,
                             block_hashes, token_ids)

    def _local_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not isinstance(self.runner, ModelRunner):
            raise RuntimeError("KV blocks move to or from one process's cache: not with parallel ranks")
        return self.runner.kv_caches

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; returns its last output, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.detokenizer.finish()
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req, [], None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration: the output delta of every request that gained tokens or finished."""
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator else None
        if proposals:
            proposals = self.structured.filter_proposals(proposals, {r.request_id: r.grammar for r in
                                                                     self.scheduler.running if r.grammar})
        scheduled = self.scheduler.schedule(proposals)
        scheduled.grammar_bitmasks = self.structured.bitmasks(self._constrained_rows(scheduled))
        self.runner.update_states(scheduled)
        if not scheduled.num_scheduled_tokens:
            return []
        start = time.perf_counter()
        result, failed = self._execute(scheduled, list(scheduled.num_scheduled_tokens))
        if self.speculator and not failed:
            self.speculator.observe(scheduled, result, time.perf_counter() - start)
        outputs = [self._fail(request_id, error) for request_id, error in failed]
        for update in self.scheduler.update_from_output(scheduled, result):
            outputs.append(self._update_output(update))
        return outputs

    @property
    def healthy(self) -> bool:
        """Whether the engine can run a step (with parallel ranks: every one alive)."""
        return self.runner.healthy

    def shutdown(self) -> None:
        """Stop what the engine started beside this process (parallel workers, a draft's), and finish what it
        writes for the next start; idempotent."""
        self.runner.shutdown()
        if self.speculator is not None and isinstance(self.speculator.proposer, DraftModelProposer):
            self.speculator.proposer.engine.shutdown()

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler.stats(), self.kv_cache.stats_snapshot()
        return EngineStats(sched.num_running, sched.num_waiting, sched.num_preemptions, kv.num_blocks,
                           kv.num_free_blocks, kv.usage, kv.num_cached_blocks, kv.prefix_queries, kv.prefix_hits,
                           dataclasses.replace(self.speculator.stats) if self.speculator else None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.processor.render_chat(messages, add_generation_prompt)

    # --- internals --------------------------------------------------------------------------

    def _constrained_rows(self, scheduled: SchedulerOutput) -> list[tuple[str, LLMatcher, list[int]]]:
        """(request id, matcher, proposal tokens) of the constrained requests that sample this step."""
        rows = []
        for request_id, n in scheduled.num_scheduled_tokens.items():
            req = self.requests[request_id]
            if req.grammar is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows.append((request_id, req.grammar, scheduled.spec_token_ids.get(request_id, [])))
        return rows

    def _execute(
        self, scheduled: SchedulerOutput, request_ids: list[str]
    ) -> tuple[ModelRunnerOutput, list[tuple[str, Exception]]]:
        """Run a step's requests; when it raises, run its halves apart, recursively, until each failure is
        pinned on one request. One request's input (or a kernel bug only it reaches) then fails that
        request alone, for a few extra forward passes, and the others' tokens are what a clean step gives:
        re-running a step rewrites the same K/V slots. Returns the results and the failed requests."""
        try:
            part = scheduled if len(request_ids) == len(scheduled.num_scheduled_tokens) else \
                scheduled.restricted_to(request_ids)
            return self.runner.execute(part), []
        except RunnerStoppedError:  # no step can run again: not one request's failure
            raise
        except Exception as e:
            if len(request_ids) == 1:
                logger.error("request %s failed in the engine step", request_ids[0], exc_info=e)
                return ModelRunnerOutput(), [(request_ids[0], e)]
            logger.warning("an engine step of %d requests failed (%s: %s); running its halves apart to find "
                           "the request(s) that fail it", len(request_ids), type(e).__name__, e)
        mid = len(request_ids) // 2
        left, left_failed = self._execute(scheduled, request_ids[:mid])
        right, right_failed = self._execute(scheduled, request_ids[mid:])
        return left.merge(right), left_failed + right_failed

    def _fail(self, request_id: str, error: Exception) -> RequestOutput:
        """Abort a request that failed and return its last output, carrying the error."""
        out = self.abort_request(request_id)
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _update_output(self, update: RequestUpdate) -> RequestOutput:
        req = update.request
        logprobs = None
        if update.new_logprobs is not None:
            logprobs = [self._logprob_entry(token, lp) for token, lp in zip(update.new_token_ids, update.new_logprobs,
                                                                             strict=True)]
            req.cumulative_logprob += sum(lp.logprob for lp in update.new_logprobs)
        out = self._output(req, update.new_token_ids, logprobs)
        if update.prompt_logprobs is not None:
            prompt = req.prompt_token_ids
            out.prompt_logprobs = [None] + [self._logprob_entry(token, lp)
                                            for token, lp in zip(prompt[1:], update.prompt_logprobs, strict=True)]
        return out

    def _logprob_entry(self, token_id: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token first, then the top ones (as vLLM's entries are ordered)."""
        entry = {token_id: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([token_id]))}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, self.tokenizer.decode([tid]))
        return entry

    def _output(self, req: Request, new_token_ids: list[int], logprobs: list[dict[int, Logprob]] | None
                ) -> RequestOutput:
        """A request's output delta: the tokens and text it gained since its last output."""
        wants_logprobs = req.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=req.detokenizer.take_text(),
            token_ids=new_token_ids,
            cumulative_logprob=req.cumulative_logprob if wants_logprobs else None,
            logprobs=(logprobs or []) if wants_logprobs else None,
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
            error=req.error,
        )

    def _run_to_completion(self, prompts: list[tuple[str, str | list[int], SamplingParams, str | None]]) -> None:
        for request_id, prompt, params, salt in prompts:
            self.add_request(request_id, prompt, params, cache_salt=salt)
        while self.has_unfinished_requests():
            self.step()

    def _speculator(self, draft_kv_bytes: int) -> Speculator:
        """The speculator, with its draft engine for draft_model (refused here if the draft's vocabulary
        is not the target's: its token ids would mean other tokens)."""
        spec = self.plan.speculative
        if spec.method != "draft_model":
            return Speculator(spec)
        if same_tokenizer(spec.model, self.config.model.model):  # the same files: the target's, not read again
            draft_tokenizer = self.tokenizer
        else:  # read before its weights: a refusal should not wait for them
            draft_tokenizer = load_tokenizer(spec.model)
            if draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"speculative_config: the draft model {spec.model!r} has another vocabulary than "
                                 f"{self.model_name!r} ({len(draft_tokenizer)} and {len(self.tokenizer)} tokens): "
                                 "a draft must share the target's tokenizer")
        mc = self.config.model
        draft = LLMEngine(EngineConfig(
            model=dataclasses.replace(mc, model=spec.model, quantization="auto", large_steps="auto",
                                      compile=False, max_model_len=self.plan.max_model_len, draft=True),
            cache=dataclasses.replace(self.config.cache, kv_cache_memory_gb=draft_kv_bytes / 2**30,
                                      block_size=DRAFT_BLOCK_SIZE,
                                      enable_prefix_caching=True),
            scheduler=self.config.scheduler), draft_tokenizer)
        logger.info("speculative decoding: draft model %s, %d KV blocks of its own", draft.model_name,
                    draft.kv_cache.num_blocks)
        return Speculator(spec, DraftModelProposer(draft))

    def _forget_own_requests(self) -> None:
        """Forget the counts of the engine's own requests (calibration, warm-up), and what the speculator learned
        from them: nobody's traffic."""
        self.kv_cache.reset_stats()
        if self.speculator:
            self.speculator.reset()

    def _calibrate_int8_activations(self) -> None:
        """Measure each decoder linear's input range on the calibration prompts (run as requests, so
        through this engine's own forward pass), then switch those layers' large steps to int8 x int8. Ranges an
        earlier start measured under the same model, configuration and code are read instead (calibration_cache.py)."""
        start = time.perf_counter()
        layers = {name: m for name, m in self.runner.model.layers.named_modules() if isinstance(m, WeightOnlyLinear)}
        key = calibration_key(resolve_model_path(self.config.model.model)[0], self.config, self.plan)
        absmax = load_ranges(key)
        found = absmax is not None and absmax.keys() == layers.keys()
        if not found:
            greedy = SamplingParams(temperature=0, max_tokens=1)
            with record_input_ranges(layers) as absmax:
                # salted: these blocks were computed before the switch, no request may reuse them
                self._run_to_completion([
                    (f"calibration-{i}", self.apply_chat_template([{"role": "user", "content": text}])
                     if self.chat_template else text, greedy, "int8-calibration")
                    for i, text in enumerate(calibration_prompts())])
            save_ranges(key, absmax)
            self._forget_own_requests()
        self.runner.use_int8_activations({name: absmax[name] for name in layers})
        logger.info("int8 activations: %d layers calibrated in %.1fs%s", len(layers), time.perf_counter() - start,
                    " (their ranges from the cache of an earlier start)" if found else "")

    def _warm_up(self) -> None:
        """Compile before serving: one step of each shape class the compiled code specialises on (one
        token, a few tokens, more tokens than a quantized kernel takes, alone and in decode batches of
        those sizes), so no request pays for it."""
        start = time.perf_counter()
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        # decode batches of each size class: up to 8 tokens (every quantized kernel), past 8 (the int8 kernel's
        # limit) and past the plan's small-step limit (dense products)
        sizes = sorted({1, 3, 9, self.plan.small_step_max_tokens + 1})
        vocab = self.model_config.vocab_size
        batches = [[[t % vocab for t in range(100 * size + i, 100 * size + i + 20)] for i in range(size)]
                   for size in sizes if size <= self.config.scheduler.max_num_seqs]
        for batch in batches:
            self._run_to_completion([(f"warm-up-{len(batch)}-{i}", prompt, greedy, None)
                                     for i, prompt in enumerate(batch)])
        self._forget_own_requests()  # the warm-up is nobody's traffic
        if self.runner.decode_graph:
            self.runner.decode_graph.freeze()
        logger.info("compiled and warmed up in %.1fs", time.perf_counter() - start)
