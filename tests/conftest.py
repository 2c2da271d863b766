"""Shared fixtures: the real default model, loaded once per test session, and its reference."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM
from llmserve.evaluate.reference import reference_greedy, reference_model
from llmserve.loader.default_models import resolve_model_path
from llmserve.quantization import prepared_cache

# Why a test is left to the full tier (`make test-all`): each marker is registered with its reason in pyproject.toml.
# `make test` runs `-m "not full"`, so a test needs only the marker that says why it is slow.
FULL_TIER_MARKERS = ("compile", "qwen", "gemma3", "processes", "browser", "benchmark", "install", "modes", "slow",
                     "clients")
# Fixtures that start servers, gateways, Redis or tensor-parallel workers: a test that uses one (directly or through
# another fixture) is marked `processes` here, so a new test on them needs no marker of its own. The one shared
# default server (tests/server/conftest.py's `server`, started once a session) stays in the fast tier.
PROCESS_FIXTURES = {"hardened", "limited", "spec_server", "replicas", "gateway", "served", "redis_server", "tp2",
                     "qwen_server", "embedding_server"}


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
        if any(item.get_closest_marker(name) for name in FULL_TIER_MARKERS):
            item.add_marker(pytest.mark.full)


@pytest.fixture(autouse=True)
def no_prepared_weights_written(monkeypatch):
    """Engines built in tests store no prepared weights (quantization/prepared_cache.py): hundreds of configurations
    would each write their model, and a later test would map what an earlier one built. Its own tests lower the
    threshold again."""
    monkeypatch.setattr(prepared_cache, "MIN_BUILD_SECONDS", float("inf"))


# Prompts of different lengths (3 to ~300 tokens): chat-templated and raw text.
PROMPT_TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    "List three prime numbers and explain why each is prime.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker "
    "who had never once left the valley. Every morning he",
    " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(12)),
    "Summarise the following text in one sentence.\n\n"
    + " ".join(
        "Large language models generate text one token at a time, and each step reads every weight "
        "of the model from memory, which is why batching many requests together pays off."
        for _ in range(8)
    ),
]


@pytest.fixture(scope="session")
def model_path() -> str:
    return resolve_model_path(None)[0]


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    return LLM(dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_model_len=2048)


@pytest.fixture(scope="session")
def prompt_token_ids(llm_fp32: LLM) -> list[list[int]]:
    tok = llm_fp32.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPT_TEXTS]
    lengths = sorted(len(i) for i in ids)
    assert lengths[0] <= 4 and lengths[-1] >= 250, lengths  # the spread the tests rely on
    return ids


@pytest.fixture(scope="session")
def hf_model():
    return reference_model(None, torch.float32)


@pytest.fixture(scope="session")
def hf_reference(hf_model, prompt_token_ids) -> list[list[int]]:
    return [reference_greedy(hf_model, ids, 64) for ids in prompt_token_ids]


@pytest.fixture(scope="session")
def gemma3_reference():
    """transformers' Gemma3ForCausalLM from Gemma 3 270M's GGUF (its own reading and dequantization; ~35 s), loaded
    once for the model's tests and the loader's. Shared, so no test may change it (`quantized_reference` copies)."""
    return reference_model(_gemma3_name(), torch.float32)


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """Gemma 3 270M's file as our loader reads it (~5 s), once for the same tests; read, never changed, by them."""
    from llmserve.loader import load_checkpoint

    return load_checkpoint(_gemma3_name())


def _gemma3_name() -> str:
    """Its users carry tests/model_files.py's Gemma 3 marks (the skip where the file is missing, the full tier's
    marker); this skip only guards one that does not."""
    from tests.model_files import GEMMA3, GEMMA3_PATH

    if GEMMA3_PATH is None:
        pytest.skip(f"{GEMMA3} is not assembled here")
    return GEMMA3


@pytest.fixture(scope="session")
def mixed_kquant_gguf(tmp_path_factory) -> str:
    """A small Qwen2 GGUF whose fused linears mix Q4_K and Q6_K rows, as Qwen2.5-Coder-1.5B's file does
    (tests/models/mixed_gguf.py); its tokenizer is the 0.5B's, cut to 4,096 tokens."""
    return _small_qwen_gguf(tmp_path_factory, "mixed.gguf")


@pytest.fixture(scope="session")
def legacy_quant_gguf(tmp_path_factory) -> str:
    """The same small Qwen2 GGUF with its linears Q5_0 and Q8_0, as most of Qwen2.5-Coder-0.5B's are."""
    return _small_qwen_gguf(tmp_path_factory, "legacy.gguf", legacy=True)


def _small_qwen_gguf(tmp_path_factory, name: str, **kinds) -> str:
    from llmserve.loader.default_models import PARTED_MODELS, installed_path
    from tests.models.mixed_gguf import write_mixed_gguf

    vocabulary = installed_path(PARTED_MODELS["qwen2.5-coder-0.5b"])
    if vocabulary is None:
        pytest.skip("qwen2.5-coder-0.5b (whose tokenizer the test model takes) is not assembled here")
    return str(write_mixed_gguf(tmp_path_factory.mktemp("small-qwen") / name, str(vocabulary), **kinds))


@pytest.fixture(scope="session")
def embedding_server(tmp_path_factory):
    """`llmserve serve all-minilm-l6-v2`: the server's /v1/embeddings, and the gateway's replica of it."""
    from tests.server.conftest import ServerProcess

    proc = ServerProcess(tmp_path_factory.mktemp("embeddings") / "server.log", "all-minilm-l6-v2",
                         common=["--no-access-log"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
