"""The offline API, with vLLM's names: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from llmserve.config import engine_config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine.

    `LLM(model=None, **options)`: `model` is a registered name (`smollm2-135m`, the default), a `.gguf`
    file or a Hugging Face directory; `options` are the engine options, the same names as
    `llmserve serve`'s engine flags (`max_num_seqs=8` for `--max-num-seqs 8`; `engine_options()` lists
    them with their defaults), plus `device`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine_config = engine_config(model=model, **options)
        self.engine = LLMEngine(self.engine_config)
        self._ids = itertools.count()
        self._loader = threading.current_thread()
        self._warned_thread = False

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine now (they stop at exit anyway)."""
        self.engine.shutdown()

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
        prompts = [{"prompt_token_ids": self.engine.processor.encode_chat(c, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, children: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        self._check_thread()
        final: dict[str, RequestOutput] = {}
        total = sum(len(c) for c in children)
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():  # deltas, folded into each request's whole output
                    if out.request_id in final:
                        final[out.request_id].add(out)
                    else:
                        final[out.request_id] = out
                    bar.update(out.finished)
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

    def _check_thread(self) -> None:
        """Say once if this thread steps while the thread that loaded the model lives on. Each thread that runs
        PyTorch's parallel ops keeps its own OpenMP pool, and with two pools' threads on the cores libgomp's
        workers stop spinning between ops and sleep, which slows every step
        (docs/performance.md, "The default configuration"). The server has one thread load and step (AsyncLLM)."""
        if self._warned_thread or threading.current_thread() is self._loader or not self._loader.is_alive():
            return
        self._warned_thread = True
        logger.warning("LLM: generating in thread %r, but the model was loaded in thread %r, which is still "
                       "running: with a PyTorch (OpenMP) thread pool in each, steps run 15-40 %% slower; "
                       "load and generate in one thread", threading.current_thread().name, self._loader.name)


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
