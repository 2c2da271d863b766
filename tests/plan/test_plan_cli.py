"""`llmserve plan` end to end: a synthetic bench file in, the hand-computed replica count, JSON and PNG out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmserve.cli import main as llmserve_main
from llmserve.plan.simulator import SchedulerLimits, ServerLatency
from llmserve.plan.step_model import LinearStepModel

from .helpers import synthetic_bench, synthetic_rate_level

# The measured server: 20 ms a step + 5 ms per decode row + 0.1 ms per prompt token, max_num_seqs 8.
SERVER = LinearStepModel(0.020, 0.005, 0.0001)
SMALL_MODEL = ["--params", "1e8", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--memory-gb", "16"]


@pytest.fixture()
def bench_file(tmp_path: Path) -> Path:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(synthetic_bench(SERVER, 100, 50, (1, 4, 8), SchedulerLimits(max_num_seqs=8),
                                               records=True)))
    return path


def _plan(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    rc = llmserve_main(["plan", *args, "--out", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize(("rate", "hits", "replicas"), [(6.6, 0.0, 3), (11.0, 0.2, 4), (2.0, 0.0, 1)])
def test_replica_count_from_a_synthetic_bench_file(bench_file: Path, tmp_path: Path, rate: float, hits: float,
                                                   replicas: int) -> None:
    # By hand: with 100-token prompts and 50-token answers a full replica keeps 8 requests running; each
    # spends 1 prompt step and 49 decode steps, so a step carries 8 x 49/50 = 7.84 decode rows and 8/50
    # prompts (16 tokens): 20 + 39.2 + 1.6 = 60.8 ms, and 8 requests finish every 50 steps: 2.63 req/s at
    # saturation. The SLO is loose (30 s, 1 s), so capacity = 95 % of that = 2.50 req/s:
    # 6.6 req/s -> 2.64 -> 3 replicas; 11 req/s with 20 % cache hits -> 8.8 -> 3.52 -> 4; 2 req/s -> 1.
    rc, doc = _plan(tmp_path, "--bench", str(bench_file), *SMALL_MODEL, "--dollars-per-hour", "1",
                    "--rate", str(rate), "--cache-hit-share", str(hits), "--prompt-len", "100", "--output-len", "50",
                    "--max-num-seqs", "8", "--slo-ttft", "30s", "--slo-tpot", "1s", "--apis", "none")
    assert rc == 0
    assert doc["capacity"]["saturation_requests_per_s"] == pytest.approx(8 / (50 * 0.0608), rel=0.02)
    assert doc["capacity"]["requests_per_s"] == pytest.approx(0.95 * 8 / (50 * 0.0608), rel=0.02)
    assert doc["replicas"] == replicas
    assert doc["cost"]["dollars_per_month"] == pytest.approx(replicas * 730.0)
    assert doc["inputs"]["step_model"]["per_decode_row_s"] == pytest.approx(0.005, rel=0.02)


def test_wake_up_fitted_from_a_light_level_in_the_bench_files_and_overridable(
        bench_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    light = tmp_path / "light.json"
    light.write_text(json.dumps(synthetic_rate_level(SERVER, ServerLatency(wake_s=0.040), 100, 50, rate=0.3, n=40)))
    common = ["--bench", str(bench_file), str(light), *SMALL_MODEL, "--dollars-per-hour", "1", "--rate", "0.2",
              "--prompt-len", "100", "--output-len", "50", "--max-num-seqs", "8", "--apis", "none",
              "--predict-rates", "0.1"]
    rc, fitted = _plan(tmp_path, *common)
    assert rc == 0
    assert fitted["inputs"]["wake_s"] == pytest.approx(0.040, abs=0.001)
    assert "takes 40 ms longer" in capsys.readouterr().out
    _, given = _plan(tmp_path, *common, "--wake-ms", "0")
    assert given["inputs"]["wake_s"] == 0.0
    # at a light load most requests pay it: the median TTFT is a prompt step (20 + 10 ms) plus the wake-up
    assert fitted["per_replica"]["predicted"]["ttft_p50_ms"] == pytest.approx(
        given["per_replica"]["predicted"]["ttft_p50_ms"] + 40, abs=2)
    assert llmserve_main(["plan", *common, "--wake-ms", "-5"]) == 2


def test_a_tight_slo_lowers_capacity(bench_file: Path, tmp_path: Path) -> None:
    common = ["--bench", str(bench_file), *SMALL_MODEL, "--dollars-per-hour", "1", "--rate", "2",
              "--prompt-len", "100", "--output-len", "50", "--max-num-seqs", "8", "--apis", "none"]
    _, loose = _plan(tmp_path, *common, "--slo-ttft", "30s", "--slo-tpot", "1s")
    # a lone request: TPOT 25 ms (20 + 5); 45 ms allows about 4-5 running at once, not 8
    _, tight = _plan(tmp_path, *common, "--slo-ttft", "30s", "--slo-tpot", "45ms")
    assert tight["capacity"]["requests_per_s"] < 0.8 * loose["capacity"]["requests_per_s"]
    assert tight["capacity"]["at_capacity"]["tpot_p99_ms"] <= 45.0
    rc, alone = _plan(tmp_path, *common, "--slo-ttft", "30s", "--slo-tpot", "20ms")  # below a lone request's
    assert rc == 1 and alone["feasible"] is False and "alone" in alone["reason"]


def test_cli_end_to_end_writes_json_and_png(bench_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    rc, doc = _plan(tmp_path, "--model", "smollm2-135m", "--quantization", "int4", "--bench", str(bench_file),
                    "--dollars-per-hour", "0.08", "--rate", "1.5", "--prompt-len", "100", "--output-len", "50",
                    "--apis", "gpt-4o-mini,gemini-2.0-flash", "--api", "mine=0.02,0.05", "--predict-rates", "0.5,1",
                    "--plot", str(png))
    assert rc == 0
    text = capsys.readouterr().out
    assert "## llmserve plan: smollm2-135m (int4, KV bf16)" in text and "| mine |" in text
    assert "One replica, simulated" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert doc["schema"] == "llmserve-plan/1" and doc["feasible"] is True
    assert doc["inputs"]["model"]["num_layers"] == 30  # from the GGUF header
    assert doc["memory"]["kv_bytes_per_token"] == 23_040 and doc["memory"]["fits"] is True
    assert [a["api"] for a in doc["apis"]] == ["gpt-4o-mini", "gemini-2.0-flash", "mine"]
    mine = doc["apis"][2]
    # break-even by hand: one replica $0.08 x 730 = $58.40 a month; the API per req/s a month:
    # 2,628,000 s x (100 x 0.02 + 50 x 0.05) / 1e6 = $11.826 -> 4.94 req/s, beyond the replica's 2.5 req/s
    # capacity: self-hosting never pays against it
    assert mine["dollars_per_month_per_request_per_s"] == pytest.approx(11.826)
    assert doc["capacity"]["requests_per_s"] < 58.4 / 11.826 and mine["break_even_requests_per_s"] is None
    cheap = doc["apis"][0]  # gpt-4o-mini: 2,628,000 x (100 x 0.15 + 50 x 0.6) / 1e6 = $118.26 per req/s
    assert cheap["break_even_requests_per_s"] == pytest.approx(58.4 / 118.26)


def test_spec_sheet_plan_and_a_model_that_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llama = ["--params", "8e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--heads", "32"]
    rc, doc = _plan(tmp_path, *llama, "--hardware", "h100-80gb", "--requests-per-day", "1e6", "--prompt-len",
                    "1000", "--output-len", "200", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
                    "--chunk", "2048", "--slo-ttft", "1s", "--slo-tpot", "50ms", "--num-requests", "500")
    assert rc == 0 and doc["feasible"] and doc["replicas"] >= 1
    assert doc["inputs"]["step_model"]["kind"].startswith("roofline")
    rc, doc = _plan(tmp_path, *llama, "--hardware", "l4", "--rate", "0.2", "--prompt-len", "2000")
    # 24 GB x 0.9 - 16 GB of bf16 weights = 5.6 GB for KV; a sequence of 2128 tokens x 128 KiB = 278,921,216 B
    assert rc == 0 and doc["memory"]["max_concurrency_kv"] == int(5.6e9 // 278_921_216) == 20
    assert doc["memory"]["max_num_seqs_used"] == 20 and doc["per_replica"]["predicted"]["max_batch"] <= 20
    rc, doc = _plan(tmp_path, *llama, "--hardware", "l4", "--memory-gb", "16", "--rate", "1")
    assert rc == 1 and doc["feasible"] is False and "do not fit" in doc["reason"]
    assert "Not feasible" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert llmserve_main(["plan", "--hardware", "l4"]) == 2  # no traffic
    assert llmserve_main(["plan", "--params", "8e9", "--hardware", "l4", "--rate", "1"]) == 2  # half a shape
    assert llmserve_main(["plan", "--model", "smollm2-135m", "--rate", "1", "--memory-gb", "8"]) == 2  # no price
    assert "error" in capsys.readouterr().err
