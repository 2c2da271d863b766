"""What an evaluation talks to: an offline engine configuration, or any OpenAI-compatible server.

Both answer the same two questions: the log-probability of each token of a given token sequence (for
perplexity: the engine's prompt logprobs, or a server's `/v1/completions` with `echo` and `logprobs`,
as vLLM and llmserve answer it), and greedy completions of prompts, with their tokens as text pieces
(what a server's logprobs spell them as), so two targets can be compared token by token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm


@dataclass
class Completion:
    text: str
    tokens: list[str]  # the generated tokens, as text pieces
    finish_reason: str | None


class OfflineTarget:
    """An `LLM` in this process (`OfflineTarget.load(model, **options)` makes one)."""

    def __init__(self, llm, description: dict[str, Any] | None = None) -> None:
        self.llm = llm
        self.name = llm.engine.model_name
        self.description = {"model": self.name, **(description or {})}
        self.tokenizer = llm.get_tokenizer()

    @classmethod
    def load(cls, model: str | None, **options: Any) -> OfflineTarget:
        from llmserve import LLM

        return cls(LLM(model, **options), options)

    def token_logprobs(self, windows: list[list[int]]) -> list[list[float | None]]:
        from llmserve import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=True)
        return [[None if e is None else e[t].logprob for t, e in zip(w, o.prompt_logprobs, strict=True)]
                for w, o in zip(windows, outs, strict=True)]

    def complete(self, prompts: list[str | list[dict]], max_tokens: int, stop: list[str] | None = None,
                 desc: str = "generating") -> list[Completion]:
        from llmserve import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
        processor = self.llm.engine.processor
        inputs = [{"prompt_token_ids": processor.encode_chat(p) if isinstance(p, list) else processor.encode(p)}
                  for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=True)
        return [Completion(o.outputs[0].text, [self.tokenizer.decode([t]) for t in o.outputs[0].token_ids],
                           o.outputs[0].finish_reason) for o in outs]


class ServerTarget:
    """An OpenAI-compatible server at `base_url` (…/v1 is added), `concurrency` requests at a time."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 8, timeout: float = 600.0) -> None:
        self.base = base_url.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.timeout = timeout
        self.model = model or httpx.get(f"{self.base}/models", headers=self.headers, timeout=30).json()["data"][0]["id"]
        self.name = self.model
        self.description = {"base_url": base_url, "model": self.model}

    def token_logprobs(self, windows: list[list[int]]) -> list[list[float | None]]:
        bodies = [{"model": self.model, "prompt": w, "max_tokens": 1, "temperature": 0, "echo": True,
                   "logprobs": 0} for w in windows]
        results = asyncio.run(self._post_all("/completions", bodies, "scoring"))
        out = []
        for w, r in zip(windows, results, strict=True):
            lps = r["choices"][0]["logprobs"]["token_logprobs"][: len(w)]
            if len(lps) != len(w):
                raise ValueError("the server did not return a logprob per prompt token (echo with logprobs)")
            out.append(lps)
        return out

    def complete(self, prompts: list[str | list[dict]], max_tokens: int, stop: list[str] | None = None,
                 desc: str = "generating") -> list[Completion]:
        bodies, paths = [], []
        for p in prompts:
            body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stop": stop or None,
                    "logprobs": 0 if isinstance(p, str) else True}
            if isinstance(p, list):
                paths.append("/chat/completions")
                bodies.append({**body, "messages": p})
            else:
                paths.append("/completions")
                bodies.append({**body, "prompt": p})
        results = asyncio.run(self._post_all(paths, bodies, desc))
        out = []
        for r in results:
            choice = r["choices"][0]
            if "message" in choice:
                text = choice["message"]["content"] or ""
                tokens = [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
            else:
                text, tokens = choice["text"], (choice.get("logprobs") or {}).get("tokens") or []
            out.append(Completion(text, tokens, choice.get("finish_reason")))
        return out

    async def _post_all(self, paths: str | list[str], bodies: list[dict], desc: str) -> list[dict]:
        paths = [paths] * len(bodies) if isinstance(paths, str) else paths
        gate = asyncio.Semaphore(self.concurrency)
        bar = tqdm(total=len(bodies), desc=desc, unit="req")
        async with httpx.AsyncClient(base_url=self.base, headers=self.headers, timeout=self.timeout) as http:

            async def one(path: str, body: dict) -> dict:
                async with gate:
                    r = await http.post(path, json=body)
                bar.update(1)
                if r.status_code != 200:
                    raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
                return r.json()

            try:
                return await asyncio.gather(*[one(p, b) for p, b in zip(paths, bodies, strict=True)])
            finally:
                bar.close()
