from __future__ import annotations

import math

import pytest

from llmserve.gateway.routing.judge import judge_request, rating


def answer(text: str, top: list[tuple[str, float]] | None = None) -> dict:
    logprobs = None if top is None else {"content": [
        {"token": top[0][0], "logprob": top[0][1],
         "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
    return {"choices": [{"message": {"role": "assistant", "content": text}, "logprobs": logprobs}]}


def test_the_rating_is_the_expected_digit_over_the_judges_probabilities():
    # P(2) = 0.5, P(4) = 0.3, " 5" = 0.1 (a leading space still counts), "x" is not a rating
    top = [("2", math.log(0.5)), ("4", math.log(0.3)), (" 5", math.log(0.1)), ("x", math.log(0.1))]
    assert rating(answer("2", top)) == pytest.approx((2 * 0.5 + 4 * 0.3 + 5 * 0.1) / 0.9)


def test_without_logprobs_the_written_digit_is_the_rating():
    assert rating(answer("I'd say 4.")) == 4.0
    assert rating(answer("hard")) == 3.0  # nothing to read: the middle of the scale
    assert rating(answer("1", [("Sure", -0.1)])) == 1.0  # logprobs with no digit among them


def test_the_judge_sees_a_bounded_request_and_answers_in_one_greedy_token():
    request = judge_request("x" * 100_000)
    assert request["max_tokens"] == 1 and request["temperature"] == 0 and request["logprobs"]
    assert len(request["messages"][0]["content"]) < 7000
