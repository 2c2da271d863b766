"""The offline API, with vLLM's names: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory_gb: float | None = None,
        kv_cache_memory_fraction: float = 0.1,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold,
        max_long_partial_prefills: int = SchedulerConfig.max_long_partial_prefills,
        seed: int = 0,
        device: str = "cpu",
        quantization: str | None = None,
        int8_activations: bool = False,
        compile: bool = False,
        attention_backend: str = "auto",
        quantized_kernels: str = "auto",
        elementwise_kernels: str = "auto",
    ) -> None:
        self.engine_config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
                              quantization=quantization, int8_activations=int8_activations,
                              compile=compile, attention_backend=attention_backend,
                              quantized_kernels=quantized_kernels, elementwise_kernels=elementwise_kernels),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_gb=kv_cache_memory_gb,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill_token_threshold,
                max_long_partial_prefills=max_long_partial_prefills,
            ),
        )
        self.engine = LLMEngine(self.engine_config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A list of ints is one tokenized prompt; a dict holds
        `prompt` or `prompt_token_ids`, and optionally `cache_salt` (no prefix sharing across salts)."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} sampling_params")
        # Validate (and tokenize) everything before anything runs: a bad prompt changes nothing.
        children: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt, p in zip(prompt_list, param_list, strict=True):
                ids = []
                for i in range(p.n):
                    child = p if p.n == 1 else p.for_choice(i)
                    rid = str(next(self._ids))
                    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                    self.engine.add_request(rid, _unwrap(prompt), child, cache_salt=salt)
                    added.append(rid)
                    ids.append(rid)
                children.append(ids)
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(children, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.engine.tokenizer.encode(
                self.engine.apply_chat_template(c, add_generation_prompt), add_special_tokens=False
            )}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, children: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        total = sum(len(c) for c in children)
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        results = []
        for ids in children:
            first = final[ids[0]]
            outputs = []
            for index, rid in enumerate(ids):
                completion = final[rid].outputs[0]
                completion.index = index
                outputs.append(completion)
            results.append(replace(first, outputs=outputs))
        return results


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _unwrap(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
