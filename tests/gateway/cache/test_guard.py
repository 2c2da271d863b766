from __future__ import annotations

import pytest

from llmserve.gateway.cache.guard import compatible


@pytest.mark.parametrize("a, b", [
    ("How do I reverse a list in Python?", "how can I reverse a Python list"),
    ("Is the clinic open on Sundays?", "Can I come to the clinic on a Sunday?"),
    ("What is 2+3?", "what's 2 + 3"),
    ("I don't want the newsletter, how do I stop it?", "How can I stop the newsletter? I do not want it."),
])
def test_rewordings_pass(a, b):
    assert compatible(a, b)


@pytest.mark.parametrize("a, b", [
    ("What is 2+3?", "What is 2+4?"),
    ("Track order 48213", "Track order 48231"),
    ("Cancel my subscription", "Don't cancel my subscription"),
    ("What happens if I pay my bill on time?", "What happens if I never pay my bill on time?"),
    ("How do I export my data from Salesforce?", "How do I export my data from HubSpot?"),
    ("Are you open on Saturday?", "Are you open on Sunday?"),
    ("What's 15% of 200?", "What's 50% of 200?"),
])
def test_answer_changing_differences_are_caught(a, b):
    assert not compatible(a, b)
