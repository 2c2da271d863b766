"""Compression scored by a real scorer: a `llmserve serve` replica of the default model, asked as the gateway asks."""

import asyncio
import re

import httpx
import pytest

from llmserve.gateway.compression import Compressor, CompressPolicy
from llmserve.gateway.compression.compressor import WINDOW_CHARS, _windows
from tests.gateway.compression.texts import PASSAGE, QUESTION
from tests.gateway.conftest import MODEL

SYSTEM = "You are a careful assistant. Answer in one short sentence."
PROTECTED = ("1887", "$12,500", "1906", '"the Long Room"', "card_catalog_id", "1927", "40,000",
             "https://archive.millbrook.example.org/library")


@pytest.fixture
def compressor(replicas) -> Compressor:
    async def complete(model: str, request: dict) -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            response = await client.post(f"{replicas[0].base}/v1/completions", json={**request, "model": model})
            response.raise_for_status()
            return response.json()

    return Compressor(complete, (MODEL,))


def in_order(short: str, long: str) -> bool:
    """Every word of `short` is a word of `long`, in the same order: compression only drops."""
    words = iter(re.findall(r"\S+", long))
    return all(any(w == x for x in words) for w in re.findall(r"\S+", short))


@pytest.mark.parametrize("rate", [0.35, 0.6])
def test_compression_keeps_the_protected_spans_and_the_rate(compressor, rate):
    body = {"model": MODEL, "compress": {"rate": rate},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": PASSAGE + "\n\nThe café menu lists naïve “Große” 日本 tea.\n\n"
                                                     + QUESTION}]}
    result = asyncio.run(compressor.apply("chat", body, CompressPolicy(scorer=MODEL, min_tokens=100)))
    assert result.refusal is None, result.refusal
    assert "compress" not in result.body and body["messages"][1]["content"].startswith(PASSAGE)  # a copy
    assert result.after <= rate * result.before
    assert result.before > 300  # the scorer's tokens of the context (the passage: about 350)
    system, user = (m["content"] for m in result.body["messages"])
    assert system == SYSTEM  # every sentence an instruction
    assert user.endswith("\n\n" + QUESTION)  # the question untouched
    context = user[:-len(QUESTION)]
    for span in PROTECTED:
        assert span in context, span
    assert in_order(context, PASSAGE + "\n\nThe café menu lists naïve “Große” 日本 tea.")
    assert len(context) < 0.8 * len(PASSAGE)
    header = result.header()
    assert header == f"rate={result.after / result.before:.2f} tokens={result.before}->{result.after}"


def test_a_short_context_goes_unscored_and_unchanged(compressor):
    body = {"model": MODEL, "prompt": "Some context.\n\nWhat is it?"}
    result = asyncio.run(compressor.apply("completions", body, CompressPolicy(scorer=MODEL, min_tokens=100)))
    assert result.refusal is not None and result.refusal.code == "short"
    assert result.body == body and result.removed == 0
    assert result.header() == "skipped: short (about 3 context tokens < min_tokens 100)"


@pytest.mark.parametrize("answer", [{"choices": [{"index": 0, "text": "x"}]}, {"choices": []}, {"choices": ["x"]},
                                    {"choices": [{"index": 0, "logprobs": {"tokens": ["The"], "token_logprobs":
                                                                           [None]}}]}])
def test_a_scorer_answer_that_cannot_be_used_leaves_the_request_as_it_came(answer):
    async def complete(model: str, request: dict) -> dict:
        return answer

    body = {"model": MODEL, "messages": [{"role": "user", "content": PASSAGE + "\n\n" + QUESTION}]}
    result = asyncio.run(Compressor(complete, (MODEL,)).apply("chat", body, CompressPolicy(scorer=MODEL,
                                                                                           min_tokens=10)))
    assert result.refusal is not None and result.refusal.code == "scorer_error"
    assert result.body == body and result.header().startswith("skipped: scorer_error (")


def test_long_contexts_are_scored_in_windows_cut_at_whitespace():
    text = ("word " * 1000).strip()
    windows = _windows(text)
    assert len(windows) == 3 and windows[0][0] == 0 and windows[-1][1] == len(text)
    assert all(a[1] == b[0] and text[b[0]] == " " for a, b in zip(windows, windows[1:], strict=False))
    assert all(e - s <= WINDOW_CHARS for s, e in windows)


# An operator's system prompt of 1,102 characters: rules whose every word can matter
POLICY_PROMPT = " ".join([
    "You are the support assistant of Harbor & Pine, an online store for outdoor furniture.",
    "Refunds are granted within 30 days of delivery when the item is unused and in its original packaging.",
    "Shipping costs are not refundable unless the item arrived damaged.",
    "Customers must send a photo of the damage within 7 days of delivery for a damaged-item claim.",
    "Never promise a refund before the claim is approved by a human agent.",
    "Do not share other customers' orders, addresses or payment details under any circumstances.",
    "If a customer asks about an order, ask for the order number and the email address used at checkout.",
    "Orders over $500 ship by freight; freight deliveries must be scheduled by phone with the carrier.",
    "Assembly is not included in the price, except for the Premium collection, which is assembled on delivery.",
    "Gift cards cannot be exchanged for cash and expire 24 months after purchase.",
    "Answer politely and briefly, in the customer's language, and end with the ticket number if one exists.",
    "Escalate to a human agent when the customer is angry, mentions a lawyer, or asks three times for the same.",
])


def test_the_system_prompt_is_never_compressed_unless_the_policy_names_it(compressor):
    """What compression may drop is the documents and earlier turns: a system prompt, the operator's rules, goes
    up whole (dropping "are", "refundable" and "item" once turned a rule into its opposite)."""
    assert len(POLICY_PROMPT) > 1000
    body = {"model": MODEL, "messages": [{"role": "system", "content": POLICY_PROMPT},
                                         {"role": "user", "content": PASSAGE + "\n\n" + QUESTION}]}
    kept = asyncio.run(compressor.apply("chat", body, CompressPolicy(scorer=MODEL, rate=0.4, min_tokens=100)))
    assert kept.refusal is None and kept.after < kept.before
    assert kept.body["messages"][0]["content"] == POLICY_PROMPT
    assert len(kept.body["messages"][1]["content"]) < len(body["messages"][1]["content"])
    named = CompressPolicy(scorer=MODEL, rate=0.4, min_tokens=100, context=("documents", "turns", "system"))
    squeezed = asyncio.run(compressor.apply("chat", body, named))
    assert len(squeezed.body["messages"][0]["content"]) < len(POLICY_PROMPT)  # only when named
