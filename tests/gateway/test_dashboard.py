"""The dashboard page in a real headless Chromium, live numbers after real traffic, no console errors."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from llmserve.gateway.dashboard import snapshot
from llmserve.gateway.metrics import GatewayMetrics
from tests.gateway.browser import CHROMIUM, Browser
from tests.gateway.conftest import MODEL, GatewayProcess, gateway_config


def test_the_snapshot_is_what_the_registry_holds():
    metrics = GatewayMetrics(lambda: [])
    metrics.requests.labels("m", "200").inc(3)
    metrics.saved.labels("m", "team", "cache_exact").inc(0.25)
    data = snapshot(metrics.registry)["metrics"]
    assert data["requests"] == [{"labels": {"model": "m", "status": "200"}, "value": 3.0}]
    assert data["saved_dollars"] == [{"labels": {"model": "m", "namespace": "team", "lever": "cache_exact"},
                                      "value": 0.25}]
    assert {s["labels"]["result"] for s in data["cache_lookups"]} == {"exact", "semantic", "miss"}


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_dashboard_shows_live_numbers_without_console_errors(tmp_path, replicas):
    config = gateway_config([r.base for r in replicas])
    config["models"][MODEL]["price"] = {"input_per_million": 100.0, "output_per_million": 400.0}
    gw = GatewayProcess(tmp_path, config)
    browser = Browser()

    async def text(selector: str) -> str:
        return await browser.evaluate(f"document.querySelector({selector!r}).textContent")

    async def until(selector: str, expected: str) -> str:
        deadline = time.monotonic() + 20
        while (value := await text(selector)) != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return value

    async def run() -> None:
        try:
            await browser.open(f"{gw.base}/dashboard")
            assert await until("#requests-total", "0") == "0"
            c = openai.OpenAI(base_url=f"{gw.base}/v1", api_key="none", max_retries=0, timeout=120)
            for question in ("Name a color.", "Name a color.", "Name a fruit."):  # the second is a cache hit
                await asyncio.to_thread(c.chat.completions.create, model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": question}])
            assert await until("#requests-total", "3") == "3"
            assert await text("#hit-rate") == "33.3 %"
            assert (await text("#spent")).startswith("$") and await text("#spent") != "$0.00"
            assert await text("#healthy") == "2 / 2"
            rows = await browser.evaluate("[...document.querySelectorAll('#replicas tbody tr')]"
                                          ".map(r => r.cells[2].textContent)")
            assert rows == ["healthy", "healthy"]
            assert await browser.evaluate("document.querySelectorAll('#levers tbody tr').length") == 1
            assert await browser.evaluate("document.getElementById('chart-rate').width") > 0
            assert browser.errors == []
        finally:
            await browser.close()

    try:
        asyncio.run(run())
    finally:
        gw.stop()
