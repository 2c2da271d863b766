"""Turns a scheduler decision into one forward pass and one sampling call.

The runner keeps its own copy of every request it runs (tokens, block table, parameters, random
generator), updated from each step's `SchedulerOutput`, and answers with a `ModelRunnerOutput`: it
never touches a `Request` or the KV manager. Per step: the scheduled requests are ordered decodes
first, their new tokens flattened into one vector, and every index the attention needs (slot mapping,
per-decode context slots, per-prefill masks) is built once with batched tensor ops from a padded
block-table tensor. Logits are computed only for the rows that sample (the last token of a request
whose tokens are all computed).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from llmserve.distributed.pipeline_parallel import PipelineStage, cut_to_stage, stage_grids
from llmserve.distributed.tensor_parallel import TensorParallel, shard_config, shard_grids, shard_model
from llmserve.engine.build_plan import BuildPlan, CompileMode, Int8Products, Kernels, LargeSteps, StepRoute
from llmserve.engine.cuda_graphs import CudaGraphs
from llmserve.engine.heap import trim_heap
from llmserve.engine.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from llmserve.kv_cache.key_smoothing import cannot_smooth, smooth_keys
from llmserve.layers.attention import ATTENTION_BACKENDS, attention_metadata
from llmserve.layers.linear import prepack_linears, release_plain_weights
from llmserve.layers.sampler import SamplingMetadata, sample
from llmserve.loader import Checkpoint, build_model
from llmserve.models.decoder import LayerMethods, compile_layers
from llmserve.models.fused_stack import fused_decode_stack
from llmserve.os_pages import drop_resident_pages, populate
from llmserve.quantization.prepared_cache import load_prepared, mapped_storages, save_prepared
from llmserve.quantization.weight_arena import ArenaInBackground, place_on_huge_pages
from llmserve.quantization.weight_only import ModelQuantizer
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.rejection_sampler import verify

logger = logging.getLogger(__name__)


class RunnerStoppedError(RuntimeError):
    """The runner cannot run another step (a parallel rank died or failed): the engine stops, where
    any other step failure fails only its requests."""


@dataclass
class _RequestState:
    """The runner's copy of a request: what it needs to build a step's inputs and to sample."""

    token_ids: list[int]  # prompt, then every token sampled so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own random stream
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def _trimming(quantize_layer: Callable[[nn.Module, int], None]) -> Callable[[nn.Module, int], None]:
    """A layer's quantization, then the heap's free pages handed back: its dense weights, freed among the quantized
    ones, would otherwise stay resident (heap.py), and a layer's worth would pile up per layer."""

    def quantize_and_trim(model: nn.Module, index: int) -> None:
        quantize_layer(model, index)
        trim_heap()

    return quantize_and_trim


@dataclass
class _Row:
    """A run of a request's query tokens in the step: its new tokens, or one of its verification decodes."""

    request: int  # index of the request in the step
    state: _RequestState
    start: int  # position of the first token
    count: int
    tokens: list[int]
    proposed_before: list[int] = field(default_factory=list)  # proposal tokens between the request's and these


class ModelRunner:
    """Builds the model as the plan says, owns it and its KV caches, and runs steps."""

    healthy = True  # one process: if it runs, it is healthy (see distributed/executor.py for several)

    def __init__(self, plan: BuildPlan, ckpt: Checkpoint, tp: TensorParallel | None = None,
                 prepared_key: str | None = None, pipeline: PipelineStage | None = None) -> None:
        """`tp`: this process's rank of a tensor-parallel group (it builds and runs its slice of the model).
        `pipeline`: its stage of a pipeline (it builds and runs that stage's layers; only the last stage samples).
        `prepared_key`: where a quantized model built layer by layer, every step on its kernels, is kept for the next
        start, and read from (quantization/prepared_cache.py); None: always built."""
        self.plan = plan
        self.config = ckpt.config
        self.device = torch.device(plan.device)
        self.block_size = plan.kv_cache.block_size
        self.eos_token_ids = ckpt.eos_token_ids  # banned until min_tokens, unless ignore_eos
        self.attention = ATTENTION_BACKENDS[plan.attention]()
        methods = LayerMethods(self.attention, native_elementwise=plan.elementwise == Kernels.NATIVE)
        quantized = plan.weights != "as loaded"
        # each layer quantized as soon as it is loaded (its dense weights released before the next is read), unless
        # something reads the dense model first: key smoothing, or cutting it into tensor-parallel ranks or stages
        streamed = quantized and tp is None and pipeline is None and plan.kv_cache.dtype != torch.int8
        # kept only where every step runs the quantized kernels: a dense or int8 copy would double what is written
        prepared_key = prepared_key if streamed and plan.large_steps == LargeSteps.QUANTIZED else None
        build_start = time.perf_counter()
        model = load_prepared(prepared_key) if prepared_key else None
        self.prepared_from_cache = model is not None
        # built only for a model not mapped: the file's grids it takes are read when first used (loader/checkpoint.py)
        quantizer = ModelQuantizer(
            plan.weights, plan.small_step_kernels == Kernels.NATIVE, plan.small_step_max_tokens, ckpt.grids,
            plan.head, plan.activation_parts, every_step=plan.large_steps == LargeSteps.QUANTIZED,
        ) if quantized and not self.prepared_from_cache else None
        if streamed:  # the quantizer holds the grids now, and drops each as its weight is quantized
            ckpt.int4_grids = ckpt.int8_grids = ckpt.fp8_grids = None
        if model is not None:  # as an earlier start built it; its layers attend through this runner's backend
            logger.info("prepared weights mapped from the cache in %.1fs", time.perf_counter() - build_start)
            for layer in model.layers:
                layer.self_attn.backend = self.attention
        else:
            model = build_model(ckpt, plan.dtype, plan.device, methods,
                                _trimming(quantizer.layer) if streamed else None)
        trim_heap()  # the decoded tensors are freed: their pages go back before quantizing (heap.py)
        # before quantizing: folded into the dense rows and the file's int4 grid (kv_cache/key_smoothing.py)
        self.key_smoothing = None
        if plan.kv_cache.dtype == torch.int8:
            if why := cannot_smooth(model):
                logger.info("int8 KV cache: keys not smoothed: %s", why)
            else:
                self.key_smoothing = smooth_keys(model, ckpt.tokenizer, ckpt.int4_grids)
                logger.info(self.key_smoothing.describe())
        # what the whole-model quantizer below takes (as key smoothing left them); a model that keeps its loaded
        # weights never reads them
        grids = ckpt.grids if quantizer is not None and not streamed else None
        kv_spec = plan.kv_cache
        if tp is not None:  # the dense model cut to this rank's heads, units and vocabulary rows, then quantized
            shard_model(model, tp)
            if grids is not None:
                grids = {method: shard_grids(found, ckpt.config, tp) for method, found in grids.items()}
            self.config = shard_config(ckpt.config, tp.size)
            kv_spec = dataclasses.replace(kv_spec, num_kv_heads=self.config.num_kv_heads)
        self.pipeline = pipeline
        if pipeline is not None:  # this stage's layers (their cache only), renumbered from 0, grids alike
            cut_to_stage(model, pipeline)
            if grids is not None:
                grids = {method: stage_grids(found, pipeline.layers) for method, found in grids.items()}
            kv_spec = dataclasses.replace(kv_spec, num_layers=len(pipeline.layers))
        if streamed and not self.prepared_from_cache:
            quantizer.output_head(model)
        elif quantizer is not None and not streamed:  # after key smoothing and the ranks' cut, on their grids
            dataclasses.replace(quantizer, grids=grids)(model)
        self.prepared_writer = None  # the thread writing the prepared weights for the next start, if any
        if prepared_key and not self.prepared_from_cache:  # written beside the serving process, not before it (and
            # before oneDNN's packed copies, which do not pickle)
            self.prepared_writer = save_prepared(prepared_key, model, time.perf_counter() - build_start)
        # eager steps read the packed copies only: the plain ones go, unless a compiled graph (it traces `F.linear`) or
        # int8-activation calibration (it smooths the plain weight) reads them
        release = plan.compile == CompileMode.OFF and not plan.int8_activations
        if packed := prepack_linears(model, release_plain=release):
            logger.info("%d linear weights prepacked for oneDNN", packed)
        if plan.compile == CompileMode.OFF and model.lm_head is not None:  # int8 calibration reads the decoder
            # layers' plain weights, never the head's (SmolLM2's dense head copy: 54 MB beside its packed one)
            release_plain_weights(model.lm_head)
        # a mapped model serves from the file's pages at once and moves onto huge pages between two steps, its arena
        # prepared beside serving; one built here moves now, its originals freed as it goes (a lower peak)
        self._arena: ArenaInBackground | None = None
        if plan.huge_pages and self.prepared_from_cache and plan.compile == CompileMode.OFF \
                and not plan.cuda_graph_max_tokens:
            self._arena = ArenaInBackground(model)
        elif plan.huge_pages:
            try:
                mapped = mapped_storages(model) if self.prepared_from_cache else []
                populate(mapped)
                placed = place_on_huge_pages(model)
                logger.info("%.1f MB of streamed weights placed on huge pages", placed / 1e6)
                drop_resident_pages(mapped)  # the file pages the copy read (the embedding faults back as used)
            except OSError as e:  # refused before any weight moved: they stay where they are
                logger.warning("the weights stay on the allocator's pages: huge pages refused (%s)", e)
        if plan.batch_invariant:
            self.attention.take_prompt_tokens_as_decodes()
        if plan.compile != CompileMode.OFF:
            self.attention.stay_eager_in_compiled_graphs()
        if plan.compile == CompileMode.LAYERS:
            compile_layers(model)  # the PyTorch attention path: per layer, attention left eager
        self.model = model
        # CUDA graphs' padded rows write to one more block, which the KV manager never hands out
        self.kv_caches = kv_spec.allocate(plan.num_kv_blocks + bool(plan.cuda_graph_max_tokens), plan.device)
        # decode-only steps as one compiled graph (needs the native kernels; see decode_graph.py), and the
        # smallest of them as one native call
        self.decode_graph = None
        if plan.compile == CompileMode.GRAPH:  # imported here: a start compiling nothing skips Inductor's slow import
            from llmserve.engine.decode_graph import DecodeGraph
            self.decode_graph = DecodeGraph(model, self.kv_caches)
        self.fused_stack = fused_decode_stack(model, self.kv_caches) if plan.fused_decode_max_tokens else None
        self.cuda_graphs = CudaGraphs(model, self.kv_caches, plan.num_kv_blocks, self.block_size,
                                      -(-plan.max_model_len // self.block_size),
                                      plan.cuda_graph_max_tokens, capture=self.device.type == "cuda",
                                      ) if plan.cuda_graph_max_tokens else None
        self._requests: dict[str, _RequestState] = {}
        trim_heap()  # and the quantizers' temporaries

    def use_int8_activations(self, absmax: dict[str, torch.Tensor]) -> None:
        """Large steps int8 x int8 from now on (int8_activations.py), for each decoder linear named in `absmax`
        (relative to `model.layers`) given the largest |input| it saw per channel; the one-call stack rebuilt
        on them, for the decode steps past its small-step kernels."""
        for name, layer in self.model.layers.named_modules():
            if name in absmax:
                layer.use_int8_activations(absmax[name], amx=self.plan.int8_products == Int8Products.AMX)
        if self.fused_stack is not None:
            self.fused_stack = fused_decode_stack(self.model, self.kv_caches)

    def swap_in_arena_weights(self) -> None:
        """Between steps: the weights the arena's thread copied since the last step swapped in, the one-call stack
        rebuilt on them, and the file's pages they leave dropped (quantization/weight_arena.py)."""
        arena = self._arena
        if left := arena.swap():
            if self.fused_stack is not None:
                self.fused_stack = fused_decode_stack(self.model, self.kv_caches)
            drop_resident_pages(left)
        if arena.done:
            self._arena = None
            if arena.error is not None:  # what was not swapped in stays on the file's pages
                logger.warning("%.1f MB of streamed weights moved onto huge pages, the others stay on the file's "
                               "pages (%s)", arena.placed / 1e6, arena.error)
            else:
                logger.info("%.1f MB of streamed weights moved onto huge pages", arena.placed / 1e6)

    @property
    def arena_pending(self) -> bool:
        """Whether weights still wait for their huge-page arena (see `swap_in_arena_weights`)."""
        return self._arena is not None

    def shutdown(self) -> None:
        """Waits for the prepared weights being written for the next start: cut short, the next start would build
        them again. Nothing else runs beside this process (see distributed/executor.py for a runner that starts
        workers)."""
        if self.prepared_writer is not None and self.prepared_writer.is_alive():
            logger.info("finishing the prepared weights for the next start")
            self.prepared_writer.join()

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply what changed since the last step: requests gone, new ones, new blocks. Once per step."""
        for request_id in out.finished_request_ids:
            self._requests.pop(request_id, None)
        for new in out.new_requests:
            seed = new.params.seed
            self._requests[new.request_id] = _RequestState(
                list(new.token_ids), len(new.token_ids), new.params,
                None if seed is None else torch.Generator().manual_seed(seed), list(new.block_ids),
                new.num_computed_tokens)
        for running in out.running_requests:
            state = self._requests[running.request_id]
            if running.resumed:
                state.block_ids = list(running.new_block_ids)
            else:
                # blocks past the computed tokens held only rejected proposals: the scheduler gave them back
                del state.block_ids[-(-running.num_computed_tokens // self.block_size):]
                state.block_ids.extend(running.new_block_ids)
            state.num_computed_tokens = running.num_computed_tokens

    def replace_sampled(self, mine: dict[str, list[int]], truth: dict[str, list[int]]) -> None:
        """Swap the tokens this runner sampled in its last `execute` (`mine`) for `truth`: a tensor-parallel
        worker's own draws for the ones rank 0 kept (they differ only where a request samples from the
        engine's random stream, which is rank 0's), or, on a pipeline stage that samples nothing, the last
        stage's tokens appended."""
        for request_id, tokens in truth.items():
            state = self._requests.get(request_id)
            if state is None:
                continue
            if drawn := mine.get(request_id):
                del state.token_ids[-len(drawn):]
            state.token_ids.extend(tokens)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens (after `update_states` for this step; `out` may be restricted to some
        of its requests) and sample; the sampled tokens join the requests' own token lists.

        A request with proposal tokens runs its last token and each proposal as decodes of their own (one
        query token each, the same block table, contexts one longer each): every layer writes the step's
        K/V before it attends, so each sees the ones before it, and the step stays decode-only. For the same
        reason a step whose tokens all fit the one-call decode stack runs a short prompt chunk as decodes too
        (a chunk after its cached context, as a speculative draft's catch-up on verified tokens is): it takes
        that call rather than the layer-by-layer prefill path, which costs a draft's short catch-up far more
        (docs/performance.md, "Speculative decoding")."""
        if self._arena is not None:
            self.swap_in_arena_weights()
        ids = list(out.num_scheduled_tokens)
        as_decodes = (out.total_num_scheduled_tokens <= self.plan.fused_decode_max_tokens
                      and all(self._requests[i].params.prompt_logprobs is None for i in ids))
        rows: list[_Row] = []
        for index, request_id in enumerate(ids):
            r = self._requests[request_id]
            start, n = r.num_computed_tokens, out.num_scheduled_tokens[request_id]
            draft = out.spec_token_ids.get(request_id)
            if draft:
                rows.extend(_Row(index, r, start + j, 1, [token], draft[:j])
                            for j, token in enumerate([r.token_ids[start], *draft]))
            elif as_decodes:
                rows.extend(_Row(index, r, start + j, 1, [token])
                            for j, token in enumerate(r.token_ids[start : start + n]))
            else:
                rows.append(_Row(index, r, start, n, r.token_ids[start : start + n]))
        # decodes (one new token) first, shortest context first: they form the decode groups of the attention
        rows.sort(key=lambda row: (row.count != 1, row.start))
        counts = [row.count for row in rows]
        starts = [row.start for row in rows]
        token_ids = [t for row in rows for t in row.tokens]

        dev = self.device
        tables = [row.state.block_ids for row in rows]
        route = self.plan.step_route(len(token_ids) == len(rows), len(token_ids), self.decode_graph is not None)
        if route == StepRoute.CUDA_GRAPH:  # one token each: row i is token i
            first_token = list(range(len(rows)))
            hidden = self.cuda_graphs(token_ids, starts, tables)
        else:
            first_token, hidden = self._forward(route, token_ids, counts, starts, tables)
        result = ModelRunnerOutput({request_id: [] for request_id in ids})
        if self.pipeline is not None and not self.pipeline.last:  # its hidden states went on to the next stage
            return result
        for i, row in enumerate(rows):
            if row.state.params.prompt_logprobs is not None and row.start + 1 < row.state.num_prompt_tokens:
                first = first_token[i]
                result.prompt_logprobs[ids[row.request]] = self._prompt_logprobs(
                    row.state, row.start, hidden[first : first + row.count])
        # rows that sample: a request's last token, and each of its proposals (those by request and position)
        sampling = [i for i, row in enumerate(rows) if row.start + row.count >= len(row.state.token_ids)]
        if out.spec_token_ids:
            sampling.sort(key=lambda i: (rows[i].request, rows[i].start))
        if not sampling:
            return result
        if len(sampling) < len(token_ids) or out.spec_token_ids:  # else every token samples, in order: all of hidden
            hidden = hidden[torch.tensor([first_token[i] + counts[i] - 1 for i in sampling], device=dev)]
        sampling_meta = self._sampling_metadata([rows[i] for i in sampling], self.config.vocab_size)
        native_argmax = self.plan.argmax == Kernels.NATIVE
        requests = list(dict.fromkeys(rows[i].request for i in sampling))  # in the order of their rows
        if out.grammar_bitmasks:
            sampling_meta.allowed = _allowed_tokens(out, [ids[index] for index in requests])
        # a step that reads only each row's best token takes it from the head's output as it is (no float32 copy)
        logits = self.model.compute_logits(hidden, as_float=bool(out.spec_token_ids) or sampling_meta.reads_logits)
        if out.spec_token_ids:
            drafts = [out.spec_token_ids.get(ids[index], []) for index in requests]
            sampled = verify(logits, sampling_meta, drafts, native_argmax)
        else:
            sampled = [[token] for token in sample(logits, sampling_meta, native_argmax)]
        for index, tokens in zip(requests, sampled, strict=True):
            request_id = ids[index]
            self._requests[request_id].token_ids.extend(t.token_id for t in tokens)
            result.sampled_token_ids[request_id] = [t.token_id for t in tokens]
            if tokens[0].logprob is not None:
                result.logprobs[request_id] = [TokenLogprobs(t.logprob, t.rank, t.top) for t in tokens]
        return result

    def _forward(self, route: StepRoute, token_ids: list[int], counts: list[int], starts: list[int],
                 tables: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        """Hidden states of the step's tokens, rows in order (and each row's first token in them), on every
        route but CUDA graphs: the attention's indices built here for all layers at once. A decode-only step's
        are made from Python lists, a tensor each: after a step's weight stream every op runs on cold caches, so
        each op saved counts in a small step."""
        dev = self.device
        starts_t = torch.tensor(starts)
        num_rows = len(counts)
        if len(token_ids) == num_rows:  # one token each (a decode-only step): row i is token i
            row_of_token, first_token = None, list(range(num_rows))
            positions = starts_t
        else:  # a prompt's tokens: index ops are kept off the one-token path, where each counts
            counts_t = torch.tensor(counts)
            row_of_token = torch.repeat_interleave(torch.arange(num_rows), counts_t)
            first_token_t = torch.cumsum(counts_t, 0) - counts_t
            positions = torch.arange(len(token_ids)) - first_token_t[row_of_token] + starts_t[row_of_token]
            first_token = first_token_t.tolist()
        meta = attention_metadata(self.attention, tables, row_of_token, positions, counts, starts,
                                  first_token, self.block_size, self.config.num_kv_heads,
                                  self.config.num_heads, self.plan.dtype, dev)
        input_ids, positions = torch.tensor(token_ids, device=dev), positions.to(dev)
        if route == StepRoute.FUSED:
            return first_token, self.model.forward_fused(self.fused_stack, input_ids, positions, meta)
        forward = self.decode_graph if route == StepRoute.GRAPH else self.model
        return first_token, forward(input_ids, positions, self.kv_caches, meta)

    def _prompt_logprobs(self, r: _RequestState, start: int, hidden: torch.Tensor) -> list[TokenLogprobs]:
        """The logprob of each prompt token after `start` given those before it, from the hidden states of
        positions start .. start + len(hidden) - 1 (each scores the next token; the last prompt position
        scores what is sampled, not a prompt token)."""
        end = min(start + len(hidden), r.num_prompt_tokens - 1)  # positions whose next token is a prompt token
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[: end - start]), dim=-1)
        targets = torch.tensor(r.token_ids[start + 1 : end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        k = r.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        return [TokenLogprobs(lp, rank, list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
                              if top is not None else [])
                for i, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist(), strict=True))]

    def _sampling_metadata(self, rows: list[_Row], vocab_size: int) -> SamplingMetadata:
        """Per sampling row: its request's parameters, and its history (the proposals before it included)
        for penalties and min_tokens."""
        reqs = [row.state for row in rows]
        params = [r.params for r in reqs]
        dev = self.device
        all_greedy = all(p.greedy for p in params)
        temperature = top_k = top_p = min_p = None  # a greedy step makes no tensor: each costs on its cold caches
        if not all_greedy:
            temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                                       device=dev)
            if any(p.top_k > 0 for p in params):
                # top_k at or past the vocabulary keeps every token
                top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                     device=dev)
            if any(p.top_p < 1 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        counts = prompt_mask = presence = frequency = repetition = None
        if any(p.uses_penalties for p in params):
            counts = torch.zeros(len(reqs), vocab_size, device=dev)
            prompt_mask = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=dev)
            for i, row in enumerate(rows):
                r = row.state
                out = torch.tensor(r.output_token_ids + row.proposed_before, dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
                prompt_mask[i, torch.tensor(r.token_ids[: r.num_prompt_tokens], dtype=torch.long, device=dev)] = True
            presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
        banned = [
            (i, ([] if row.state.params.ignore_eos else self.eos_token_ids) + row.state.params.stop_token_ids)
            for i, row in enumerate(rows)
            if len(row.state.token_ids) + len(row.proposed_before) - row.state.num_prompt_tokens
            < row.state.params.min_tokens
        ]
        biased = [(i, token, value) for i, p in enumerate(params) for token, value in (p.logit_bias or {}).items()]
        bias = None
        if biased:
            rows, tokens, values = zip(*biased, strict=True)
            bias = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev),
                    torch.tensor(values, dtype=torch.float32, device=dev))
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[r.generator for r in reqs],
            output_counts=counts,
            prompt_mask=prompt_mask,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            banned=banned,
            num_logprobs=[p.logprobs for p in params],
            bias=bias,
        )


def _allowed_tokens(out: SchedulerOutput, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The constrained sampling rows and their bitmasks, for requests whose rows come in this order (a request
    with proposal tokens has one row per proposal token after its first)."""
    rows: list[int] = []
    masks = []
    first = 0
    for request_id in request_ids:
        n = 1 + len(out.spec_token_ids.get(request_id, ()))
        mask = out.grammar_bitmasks.get(request_id)
        if mask is not None:
            rows.extend(range(first, first + n))
            masks.append(mask)
        first += n
    return torch.tensor(rows), torch.from_numpy(np.concatenate(masks))
