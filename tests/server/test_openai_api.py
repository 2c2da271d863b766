"""The OpenAI API as the official client sees it, against a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess

GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_went_from_503_to_200(server: ServerProcess) -> None:
    assert 503 in server.health_statuses, server.health_statuses  # answered while the model loaded
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base}/version").json()["version"]
    server.log()  # flushes
    log = server.log_path.read_text()  # whole: the shared server has served other modules' tests since it started
    assert "serving smollm2-135m" in log and "blocks" in log and server.base in log


def test_models_lists_every_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    out = client.completions.create(model="alias", prompt="Hi", max_tokens=2)
    assert out.model == "alias"


def test_chat_stream_joins_to_the_non_stream_text(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    first, finish, last = chunks[0], chunks[-2], chunks[-1]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert finish.choices[0].finish_reason == "length"
    assert finish.choices[0].delta.content is None and finish.choices[0].delta.role is None
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[1:-1])
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_joins_to_the_non_stream_text(client: openai.OpenAI) -> None:
    prompt = "The history of the printing press"
    whole = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    # echo puts the prompt in front; token-id prompts work the same as text
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + whole.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[504, 3458, 314], max_tokens=2)
    assert by_ids.usage.prompt_tokens == 3 and by_ids.usage.completion_tokens >= 1


def test_logit_bias_bans_or_forces_a_token_streamed_as_not(client: openai.OpenAI, llm_fp32) -> None:
    prompt = "The history of the printing press"
    plain = client.completions.create(model=MODEL, prompt=prompt, logprobs=0, **GREEDY)
    first = plain.choices[0].logprobs.tokens[0]
    [token_id] = llm_fp32.get_tokenizer().encode(first)  # the same tokenizer as the server's model
    banned = client.completions.create(model=MODEL, prompt=prompt, logprobs=0, logit_bias={str(token_id): -100},
                                       **GREEDY)
    assert first not in banned.choices[0].logprobs.tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, logit_bias={str(token_id): -100},
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == banned.choices[0].text
    forced = client.completions.create(model=MODEL, prompt=prompt, logprobs=0, logit_bias={str(token_id): 100},
                                       **GREEDY)
    assert forced.choices[0].logprobs.tokens == [first] * 24


def test_n_choices_and_usage(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=7, temperature=1.0,
                                         max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once, not per choice
    assert out.usage.completion_tokens <= 16
    # two prompts × n=2: choices grouped by prompt, usage over all of them
    multi = client.completions.create(model=MODEL, prompt=["Hello", "The sky is"], n=2, max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[0].text == multi.choices[1].text and multi.choices[2].text == multi.choices[3].text
    assert multi.usage.completion_tokens == 16
    p1 = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.prompt_tokens
    p2 = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1).usage.prompt_tokens
    assert multi.usage.prompt_tokens == p1 + p2


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four, five, six,"
    free = client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text
    stop = free.strip().split()[2]  # a word the greedy continuation is sure to reach
    out = client.completions.create(model=MODEL, prompt=prompt, stop=[stop], **GREEDY).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == free[: free.index(stop)]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == out.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                          max_tokens=5, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", logprobs=2, max_tokens=4,
                                     temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(tok in top and len(top) == 2 for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, max_tokens=5,
                                                   temperature=0, stream=True))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_32_concurrent_streams_complete_and_free_everything(server: ServerProcess) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}:", max_tokens=16, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, len(chunks), chunks[-2].choices[0].finish_reason

    async def main() -> list[tuple[int, int, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = server.metrics()
    results = asyncio.run(main())
    assert all(tokens == 16 and reason == "length" for tokens, _, reason in results), results
    m = server.wait_idle()
    assert m["llmserve:num_requests_running"] == 0 and m["llmserve:num_requests_waiting"] == 0
    assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"] > 0
    assert m["llmserve:kv_cache_usage_perc"] == 0
    assert m["llmserve:generation_tokens_total"] - before["llmserve:generation_tokens_total"] == 32 * 16
    assert m["llmserve:request_success_total"] - before["llmserve:request_success_total"] == 32
    assert m["llmserve:time_to_first_token_seconds_count"] - before["llmserve:time_to_first_token_seconds_count"] == 32
    assert m["llmserve:request_queue_time_seconds_count"] > 0 and m["llmserve:e2e_request_latency_seconds_count"] > 0
    assert m["llmserve:inter_token_latency_seconds_count"] > 0


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server: ServerProcess) -> None:
    long_body = {"model": MODEL, "prompt": "Tell me everything about", "max_tokens": 1000,
                 "stream": True, "ignore_eos": True}
    other_body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}

    async def main() -> dict:
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=long_body) as response:
                assert response.status_code == 200
                other = asyncio.create_task(http.post("/v1/completions", json=other_body))
                lines = 0
                async for line in response.aiter_lines():
                    lines += line.startswith("data: ")
                    if lines == 4:
                        break  # leaving the block closes the connection mid-stream
            return (await other).json()

    before = server.metrics()["llmserve:generation_tokens_total"]
    other = asyncio.run(main())
    assert other["usage"]["completion_tokens"] == 16 and other["choices"][0]["finish_reason"] == "length"
    m = server.wait_idle(timeout=10)
    assert m["llmserve:num_requests_running"] == 0
    assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"]
    assert m["llmserve:generation_tokens_total"] - before < 500  # the 1000-token request stopped early


def test_disconnected_non_stream_request_is_aborted(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    before = server.metrics()["llmserve:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", json=body, timeout=1.5)
    m = server.wait_idle(timeout=10)
    assert m["llmserve:num_requests_running"] == 0
    assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"]
    assert m["llmserve:generation_tokens_total"] - before < 500


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        (b'{"model": "smollm2-135m", "prompt": "Hi", ', 400, None, "JSON"),
        ({"prompt": "Hi", "temperature": -1}, 400, "temperature", "temperature"),
        ({"prompt": "Hi", "top_p": 0}, 400, "top_p", "top_p"),
        ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
        ({"prompt": "Hi", "n": 0}, 400, "n", "n"),
        ({"prompt": [], "max_tokens": 4}, 400, "prompt", "empty"),
        ({"prompt": "Hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
        ({"prompt": "word " * 2100}, 400, "prompt", "2048"),
        ({"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens", "2048"),
        ({"messages": [], "max_tokens": 4}, 400, "messages", "messages"),
        ({"prompt": "Hi", "logit_bias": {"the": 5}}, 400, "logit_bias", "'the'"),
        ({"prompt": "Hi", "logit_bias": {"49152": 5}}, 400, "logit_bias", "49152"),
        ({"prompt": "Hi", "logit_bias": {"15": 150}}, 400, "logit_bias", "[-100, 100]"),
    ],
)
def test_bad_requests_get_an_envelope_and_change_nothing(server: ServerProcess, body, status, param, needle) -> None:
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{server.base}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"] and error["param"] == param
    ok = httpx.post(f"{server.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_body_over_the_limit_is_413(server: ServerProcess) -> None:
    big = {"prompt": "x" * (1 << 20), "max_tokens": 1}
    r = httpx.post(f"{server.base}/v1/completions", json=big, timeout=60)  # Content-Length says it
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the bytes that arrive are counted
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"y" * 32768
        yield b'"}'

    r = httpx.post(f"{server.base}/v1/completions", content=chunked(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.post(f"{server.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_openai_client_raises_the_matching_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)


def test_metrics_are_prometheus_text(server: ServerProcess) -> None:
    r = httpx.get(f"{server.base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_kv_blocks_free",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"):
        assert f"llmserve:{name}" in r.text, name


def test_echo_with_logprobs_scores_the_prompt(server: ServerProcess, llm_fp32) -> None:
    """What perplexity through an API reads: each prompt token's logprob, as the engine computes it offline."""
    from llmserve import SamplingParams

    ids = llm_fp32.get_tokenizer().encode("The history of the printing press begins in the fifteenth century.")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    whole = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    [offline] = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                  use_tqdm=False)
    lps = whole["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None  # the first token has no context
    expected = [entry[t].logprob for t, entry in zip(ids[1:], offline.prompt_logprobs[1:], strict=True)]
    assert lps["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert len(lps["tokens"]) == len(ids) + 2 and "".join(lps["tokens"]) == whole["text"]
    assert lps["text_offset"][len(ids)] == len("".join(lps["tokens"][: len(ids)]))
    streamed = []
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += (choice.get("logprobs") or {}).get("token_logprobs") or []
    assert streamed[0] is None and streamed[1:] == pytest.approx(lps["token_logprobs"][1:], abs=1e-6)


def test_prompt_logprobs_are_served_or_refused(server: ServerProcess, llm_fp32) -> None:
    """vLLM's prompt_logprobs on /v1/completions: each prompt token's logprob (the first has none) and its k most
    likely, as the engine computes them offline; refused on a stream rather than ignored."""
    from llmserve import SamplingParams

    ids = llm_fp32.get_tokenizer().encode("Large language models generate text one token at a time.")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["prompt_logprobs"]
    [offline] = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                  use_tqdm=False)
    assert served[0] is None and len(served) == len(ids)
    for token, entry, reference in zip(ids[1:], served[1:], offline.prompt_logprobs[1:], strict=True):
        assert str(token) in entry and len(entry) <= 3
        assert entry[str(token)]["logprob"] == pytest.approx(reference[token].logprob, abs=1e-4)
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(token) or e["rank"] <= 2)
        assert ranks[:2] == [1, 2]
    refused = httpx.post(f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    plain = httpx.post(f"{server.base}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60)
    assert plain.json()["choices"][0]["prompt_logprobs"] is None
