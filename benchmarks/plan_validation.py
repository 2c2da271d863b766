#!/usr/bin/env python3
"""Does `llmserve plan`'s simulator predict a real server? Fit on a concurrency sweep, check at request rates.

    .venv/bin/python benchmarks/plan_validation.py                 # ~22 minutes on 2 cores
    .venv/bin/python benchmarks/plan_validation.py --reuse --out-dir benchmarks/results/plan-validation/zen5
                                                                   # re-predict from a run's saved bench files

Why: `llmserve plan` sizes a deployment from a step-time model fitted to `llmserve bench` files; this is the check
that its predictions hold against a measured server (target: within 20 % on TTFT p50/p99 and throughput).
docs/performance.md, "Capacity planning", has the runs per host.

1. Start `llmserve serve` (the default model, default flags) and wait for /health.
2. `llmserve bench` closed loop at a concurrency sweep, and one concurrency-1 level of short prompts (its
   TTFT beside the sweep's tells the front end from the prompt's cost): the step-time model is fitted to
   them (plan/fit.py); then a light request-rate level (a tenth of the sweep's highest requests/s), where
   most requests find the engine idle: the wake-up cost of a step after idle is fitted to it.
3. `llmserve bench --request-rate` (Poisson arrivals) at three rates, fractions of the first sweep's highest
   measured requests/s, fixed before measuring; none of their data enters the fit.
4. Steps 2-3 again, `--rounds` times in all, each with its own seed: a shared host's speed drifts by ~20 % over
   minutes, so a fit measured in one stretch and rates in the next compare two machines. Interleaved rounds show
   both the same mix.
5. The simulator's predictions for those rates against the measurements, each rate's rounds pooled: p50/p99
   TTFT, TPOT and throughput. Two predictions: "Poisson", what `llmserve plan` does (fresh Poisson arrivals,
   fixed mean lengths, averaged over seeds), and "replay" (the very arrival times and token counts of the
   run, which takes the luck of one run's arrivals out of the comparison).

Writes <out-dir>/plan_validation.{json,md,png} and the bench files plan_validation_{sweep,short,idle,rates}_r<N>.json,
compacted to the fields the fit and the replay read (default out dir: benchmarks/results/plan-validation/<host>).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import host_tag, machine_facts, port_free, stop_group  # noqa: E402

from llmserve.bench.metrics import percentile  # noqa: E402
from llmserve.bench.report import load_result, render_table  # noqa: E402
from llmserve.plan.fit import fit_step_model, rate_levels  # noqa: E402
from llmserve.plan.planner import Replica, SimSettings, predict  # noqa: E402
from llmserve.plan.simulator import SchedulerLimits  # noqa: E402
from llmserve.plan.traffic import LengthDist, SimRequest  # noqa: E402

METRICS = (("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"), ("TPOT p50 ms", "tpot_p50_ms"),
           ("TPOT p99 ms", "tpot_p99_ms"), ("req/s", "req_per_s"), ("out tok/s", "output_tok_per_s"))
TARGET = 0.20


class ForeignCpu(threading.Thread):
    """Cores the rest of the machine keeps busy (all CPU time outside this script's process tree), sampled
    every second: on a 2-core host another job's work shows up as queueing the simulator knows nothing of,
    so the report says how much there was during each measured level."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []  # (end of interval, foreign cores over it)
        self.stop_event = threading.Event()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _mine() -> float:
        me = psutil.Process()
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                c = p.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
        return total

    def run(self) -> None:
        t0, busy0, mine0 = time.time(), self._busy(), self._mine()
        while not self.stop_event.wait(1.0):
            t, busy, mine = time.time(), self._busy(), self._mine()
            if mine >= mine0:  # a child that exited took its CPU time along: skip that interval
                self.samples.append((t, max(0.0, (busy - busy0) - (mine - mine0)) / (t - t0)))
            t0, busy0, mine0 = t, busy, mine

    def mean(self, start: float, end: float) -> float | None:
        xs = [f for t, f in self.samples if start < t <= end]
        return statistics.fmean(xs) if xs else None

    def wait_quiet(self, cores: float, minutes: float) -> bool:
        """Until the last minute averaged under `cores` foreign cores (at most `minutes`)."""
        deadline = time.time() + minutes * 60
        while time.time() < deadline:
            now = time.time()
            recent = self.mean(now - 60, now)
            if recent is not None and len([t for t, _ in self.samples if t > now - 60]) >= 50 and recent < cores:
                return True
            print(f"[plan-validation] waiting for a quiet machine: {recent or 0:.2f} other cores busy", flush=True)
            time.sleep(30)
        return False


def round_paths(out_dir: Path, r: int) -> dict[str, Path]:
    """Round r's bench files: the sweep, the short-prompt level, the light level, the validated rates."""
    return {kind: out_dir / f"plan_validation_{kind}_r{r}.json" for kind in ("sweep", "short", "idle", "rates")}


def level_windows(doc: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) wall-clock of each level, chained back from the run's end (levels run one after another)."""
    end, out = float(doc["finished_unix"]), []
    for level in reversed(doc["levels"]):
        start = end - float(level["summary"]["wall_s"])
        out.append((start, end))
        end = start
    return out[::-1]


def serve(args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--host", "127.0.0.1", "--port", str(args.port),
           "--no-access-log", *args.serve_flags.split()]
    print(f"[plan-validation] {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready after 900 s")


def bench(args: argparse.Namespace, out: Path, *load: str, seed: int, input_len: int | None = None) -> None:
    """One `llmserve bench` run. A level's prompts are seeded by (seed, level label): a run of another prompt
    length with a level label used before needs another seed, or its prompts are prefixes of the earlier
    ones and hit the prefix cache."""
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
           "--workload", "random", "--input-len", str(input_len or args.input_len), "--output-len",
           str(args.output_len), "--seed", str(seed), "--warmup", "2", "--no-progress", "--out", str(out), *load]
    print(f"[plan-validation] {' '.join(cmd)}", flush=True)
    subprocess.check_call(cmd, cwd=REPO)


# what the fit and the replay read of each request (plan/fit.py); the rest of a bench record is left out
KEPT_FIELDS = ("ok", "start_ms", "ttft_ms", "latency_ms", "tpot_ms", "output_tokens", "prompt_tokens")


def compact(path: Path) -> None:
    """Keep of a bench file's requests only what the comparison reads: a twentieth of the size."""
    doc = json.loads(path.read_text())
    for level in doc.get("levels", []):
        level["requests"] = [{k: rec.get(k) for k in KEPT_FIELDS} for rec in level.get("requests", [])]
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


def figures(ttft_s: list[float], tpot_s: list[float], output_tokens: int, wall_s: float) -> dict[str, float]:
    """The compared figures of requests pooled over rounds: percentiles over all of them, throughput over the
    rounds' summed wall time (one definition for the measured and the replayed runs)."""
    return {"ttft_p50_ms": percentile(ttft_s, 50) * 1e3, "ttft_p99_ms": percentile(ttft_s, 99) * 1e3,
            "tpot_p50_ms": percentile(tpot_s, 50) * 1e3, "tpot_p99_ms": percentile(tpot_s, 99) * 1e3,
            "req_per_s": len(ttft_s) / wall_s, "output_tok_per_s": output_tokens / wall_s}


def predictions(replica: Replica, rounds: list[tuple[dict[str, Any], list[SimRequest], list[dict[str, Any]]]],
                seeds: int) -> dict[str, Any]:
    """Measured, replayed and Poisson-predicted figures of one request rate, its rounds pooled: (summary,
    requests, their bench records) per round."""
    recs = [r for _s, _reqs, records in rounds for r in records]
    measured = figures([r["ttft_ms"] / 1e3 for r in recs], [r["tpot_ms"] / 1e3 for r in recs if r.get("tpot_ms")],
                       sum(int(r["output_tokens"]) for r in recs), sum(float(s["wall_s"]) for s, _r, _x in rounds))
    sims = [replica.run(reqs) for _s, reqs, _x in rounds]
    replay = figures([t for sim in sims for t in sim.ttft], [t for sim in sims for t in sim.tpot if t is not None],
                     sum(sum(sim.output_tokens) for sim in sims), sum(sim.summary()["wall_s"] for sim in sims))
    reqs = [r for _s, rs, _x in rounds for r in rs]
    rate = float(rounds[0][0]["request_rate"])
    prompt = LengthDist(statistics.fmean(r.prompt_len for r in reqs))
    output = LengthDist(statistics.fmean(r.output_len for r in reqs))
    n = max(len(reqs), 10)  # as many requests as were measured
    runs = [predict(replica, prompt, output, rate, SimSettings(n, 0.0, seed)) for seed in range(seeds)]
    poisson = {key: statistics.fmean(r[key] for r in runs) for _name, key in METRICS}
    poisson["p99_spread_ms"] = [min(r["ttft_p99_ms"] for r in runs), max(r["ttft_p99_ms"] for r in runs)]
    return {"rate": rate, "num_requests": len(reqs), "measured": measured, "poisson": poisson, "replay": replay}


def comparison_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        for name, key in METRICS:
            m, p, r = row["measured"][key], row["poisson"][key], row["replay"][key]
            busy = row.get("foreign_cores")
            label = f"{row['rate']:.2f}" + (f" ({busy:.2f} other cores)" if busy is not None else "")
            spread = row["poisson"]["p99_spread_ms"] if key == "ttft_p99_ms" else None
            pred = f"{p:.1f}" + (f" ({spread[0]:.0f}-{spread[1]:.0f})" if spread else "")
            out.append([label if name == METRICS[0][0] else "", name, f"{m:.1f}", pred,
                        f"{(p / m - 1) * 100:+.0f} %", f"{r:.1f}", f"{(r / m - 1) * 100:+.0f} %"])
    return render_table(["rate req/s", "metric", "measured", "predicted (Poisson)", "error", "predicted (replay)",
                         "error"], out, markdown=True, left=2)


def verdict(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    misses = []
    for row in rows:
        for key in keys:
            err = row["poisson"][key] / row["measured"][key] - 1
            if abs(err) > TARGET:
                misses.append(f"rate {row['rate']:.2f}: {key} {err * 100:+.0f} %")
    return misses


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, keys) in zip(axes, (("TTFT (ms)", ("ttft_p50_ms", "ttft_p99_ms")),
                                        ("TPOT (ms)", ("tpot_p50_ms", "tpot_p99_ms")),
                                        ("throughput (req/s)", ("req_per_s",))), strict=True):
        for j, key in enumerate(keys):
            ax.plot(rates, [r["measured"][key] for r in rows], "o-", color=f"C{j}", label=f"{key} measured")
            ax.plot(rates, [r["poisson"][key] for r in rows], "s--", color=f"C{j}", label=f"{key} predicted")
            ax.fill_between(rates, [r["measured"][key] * (1 - TARGET) for r in rows],
                            [r["measured"][key] * (1 + TARGET) for r in rows], color=f"C{j}", alpha=0.1)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("llmserve plan: simulator vs measured server (band: measured +-20 %)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8041)
    ap.add_argument("--serve-flags", default="", help="flags for `llmserve serve` (default: none, its defaults)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sweep", default="1:8,2:8,4:16,8:32,16:48,32:64", help="concurrency:requests,...")
    ap.add_argument("--fractions", default="0.2,0.4,0.6", help="request rates as fractions of the sweep's max")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure everything this many times, interleaved: the host's speed drifts by 20 %% over "
                         "minutes, so the fit and the validated rates must see the same stretch of it")
    ap.add_argument("--rate-requests", type=int, default=100, help="requests per request-rate level and round")
    ap.add_argument("--short-input-len", type=int, default=64,
                    help="prompt length of the concurrency-1 level that tells the front end from prefill (0: none)")
    ap.add_argument("--short-requests", type=int, default=12)
    ap.add_argument("--idle-fraction", type=float, default=0.1,
                    help="the light level the wake-up after idle is fitted to, as a fraction of the sweep's max")
    ap.add_argument("--idle-requests", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=20, help="Poisson predictions averaged over this many seeds")
    ap.add_argument("--reuse", action="store_true", help="no server: predict from the saved bench files")
    ap.add_argument("--max-foreign", type=float, default=0.1, metavar="CORES",
                    help="sweep levels measured while other processes used more are left out of the fit")
    ap.add_argument("--wait-quiet", type=float, default=60.0, metavar="MINUTES",
                    help="first wait (up to this long) until other processes use < 0.15 cores (default 60)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default benchmarks/results/plan-validation/<host>")
    args = ap.parse_args()
    args.out_dir = args.out_dir or REPO / "benchmarks" / "results" / "plan-validation" / host_tag()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    limits = SchedulerLimits()  # the server runs its defaults: max_num_seqs 64, 512 tokens, chunks of 256
    levels = [lv.split(":") for lv in args.sweep.split(",")]
    foreign_path = args.out_dir / "plan_validation_foreign_cpu.json"
    if not args.reuse:
        if not port_free(args.port):
            raise SystemExit(f"port {args.port} is busy")
        for old in args.out_dir.glob("plan_validation_*_r*.json"):
            old.unlink()
        watch = ForeignCpu()
        watch.start()
        if args.wait_quiet > 0 and not watch.wait_quiet(0.15, args.wait_quiet):
            print("[plan-validation] the machine did not get quiet; measuring anyway", flush=True)
        proc = serve(args, args.out_dir / "plan_validation.server.log")
        rates: list[float] = []
        idle_rate = 0.0
        try:
            for r in range(1, args.rounds + 1):
                # every round its own seed: a level label repeated with the same seed repeats its prompts,
                # which would then hit the prefix cache whole
                path = round_paths(args.out_dir, r)
                seed = 1234 + 100 * r
                bench(args, path["sweep"], "--concurrency", ",".join(c for c, _ in levels),
                      "--num-requests", ",".join(n for _, n in levels), seed=seed)
                peak = max(s["req_per_s"] for s in load_result(path["sweep"])["summary"])
                if not rates:  # fixed by round 1's sweep, before any rate is measured
                    rates = [round(float(f) * peak, 3) for f in args.fractions.split(",")]
                    idle_rate = round(args.idle_fraction * peak, 3)
                if args.short_input_len:
                    bench(args, path["short"], "--concurrency", "1", "--num-requests", str(args.short_requests),
                          input_len=args.short_input_len, seed=seed + 1)
                bench(args, path["idle"], "--request-rate", str(idle_rate), "--num-requests", str(args.idle_requests),
                      seed=seed)
                bench(args, path["rates"], "--request-rate", ",".join(map(str, rates)),
                      "--num-requests", str(args.rate_requests), seed=seed)
        finally:
            stop_group(proc, os.getpgid(proc.pid))
            watch.stop_event.set()
        paths = [p for r in range(1, args.rounds + 1) for p in round_paths(args.out_dir, r).values() if p.exists()]
        foreign = {p.name: [watch.mean(a, b) for a, b in level_windows(load_result(p))] for p in paths}
        for p in paths:
            compact(p)
        foreign_path.write_text(json.dumps(foreign, indent=1) + "\n")
    foreign = json.loads(foreign_path.read_text()) if foreign_path.exists() else {}
    found = list(itertools.takewhile(lambda path: path["sweep"].exists() and path["rates"].exists(),
                                     (round_paths(args.out_dir, r) for r in itertools.count(1))))
    if not found:
        raise SystemExit(f"no plan_validation_sweep_r1.json / _rates_r1.json in {args.out_dir}")
    docs = {kind: [load_result(path[kind]) for path in found if path[kind].exists()] for kind in found[0]}
    if not args.short_input_len:
        docs["short"] = []
    dropped, clean = [], []
    for r, (path, sweep) in enumerate(zip(found, docs["sweep"], strict=True), start=1):
        busy = foreign.get(path["sweep"].name, [None] * len(sweep["levels"]))
        dropped += [f"{lv['summary']['label']} (round {r})"
                    for lv, b in zip(sweep["levels"], busy, strict=True) if b is not None and b > args.max_foreign]
        clean.append({**sweep, "levels": [lv for lv, b in zip(sweep["levels"], busy, strict=True)
                                          if b is None or b <= args.max_foreign]})
    t0 = time.perf_counter()
    idle, short = docs["idle"], docs["short"]
    fit = fit_step_model([*clean, *short, *idle], limits)
    replica = Replica(fit.model, limits, fit.latency)
    by_rate = zip(*[rate_levels(doc) for doc in docs["rates"]], strict=True)  # each rate's levels, a round each
    rows = [predictions(replica, list(rounds), args.seeds) for rounds in by_rate]
    busy_rates = [foreign.get(path["rates"].name, []) for path in found]  # per round, a figure per rate (or None)
    for i, row in enumerate(rows):
        row["foreign_cores"] = max((busy[i] for busy in busy_rates if i < len(busy) and busy[i] is not None),
                                   default=None)
    sim_s = time.perf_counter() - t0
    sweep = docs["sweep"][0]
    peak = max(s["req_per_s"] for s in sweep["summary"])
    facts = machine_facts()
    doc = {"machine": facts, "rounds": len(found), "bench_files": [p.name for path in found for p in path.values()
                                                                    if p.exists()],
           "peak_req_per_s": peak, "step_model": fit.describe(), "comparison": rows, "target": TARGET,
           "simulation_seconds": sim_s, "foreign_cores": foreign, "levels_left_out_of_fit": dropped,
           "misses": verdict(rows, ("ttft_p50_ms", "ttft_p99_ms", "req_per_s"))}
    (args.out_dir / "plan_validation.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, args.out_dir / "plan_validation.png")
    fit_rows = [[o["source"], f"{o['measured_ms']:.1f}", f"{o['fitted_ms']:.1f}", f"{o['error'] * 100:+.1f} %"]
                for o in doc["step_model"]["observations"]]
    sm = fit.model
    rate_list = ", ".join(f"{r['rate']:.2f}" for r in rows)
    ttft_lengths = sorted({round(o.prompt_len) for o in fit.observations if o.front_end})
    if "front_end_s" in fit.columns:
        front_text = ("fitted with the prompt's cost to the mean TTFT at c=1 of "
                      + " and ".join(f"{p:.0f}" for p in ttft_lengths) + "-token prompts")
    elif fit.ttft_c1:
        front_text = "TTFT at c=1 {:.1f} ms measured, {:.1f} ms of engine steps".format(*(v * 1e3 for v in fit.ttft_c1))
    else:
        front_text = "no concurrency-1 level in the fit: taken as 0"
    idle_rates = ", ".join(sorted({f"{s['request_rate']:g}" for doc in idle for s in doc["summary"]}))
    wake_text = (f"a step after {fit.latency.idle_s * 1e3:.0f} ms or more of idle {fit.latency.wake_s * 1e3:.1f} ms "
                 f"longer (median over the {fit.wake_samples} requests of the light levels, {idle_rates} req/s, "
                 "that found the engine idle)" if idle else "no light level: no wake-up cost")
    cfg = sweep.get("config", {})
    short_levels = [s for doc in short for s in doc["summary"]]
    short_text = (f" and c=1 at {statistics.fmean(s['prompt_tokens_server_mean'] for s in short_levels):.0f}-token "
                  f"prompts ({short_levels[0]['num_requests']} requests)" if short_levels else "")
    sweep_levels = ",".join(f"{s['concurrency']}:{s['num_requests']}" for s in sweep["summary"])
    fractions = ", ".join(f"{r['rate'] / peak:.2f}" for r in rows)
    per_rate = "/".join(str(r["num_requests"]) for r in rows)
    busy_text = "; ".join(", ".join("-" if b is None else f"{b:.2f}" for b in foreign.get(path["sweep"].name, []))
                          for path in found) or "not measured"
    left_out = (f" Left out of the fit (other processes above {args.max_foreign:g} cores): {', '.join(dropped)}."
                if dropped else "")
    report = "\n\n".join([
        "# `llmserve plan`: the simulator against a measured server",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/plan_validation.py`; {facts['cpu']}, "
        f"{facts['cpus']} CPUs; `llmserve serve` defaults ({sweep.get('server', {}).get('model')}); `llmserve bench "
        f"--workload {cfg.get('workload')} --input-len {cfg.get('input_len')} --output-len {cfg.get('output_len')}`.",
        f"{len(found)} rounds, interleaved (each: the sweep, the short prompts, the light level, the rates). "
        f"Step model fitted to the sweeps ({sweep_levels}, concurrency:requests){short_text}: "
        f"{sm.overhead_s * 1e3:.2f} ms + "
        f"{sm.per_decode_row_s * 1e3:.3f} ms per decode row + {sm.per_prefill_token_s * 1e3:.4f} ms per prompt "
        f"token + {sm.per_attention_pair_s * 1e9:.3f} ns per attention pair (fitted: {', '.join(fit.columns)}); "
        f"front end {fit.latency.front_end_s * 1e3:.1f} ms before the engine sees a request ({front_text}); "
        f"{wake_text}.",
        render_table(["closed-loop level (rounds in order)", "measured ms", "fitted ms", "error"], fit_rows,
                     markdown=True),
        f"Request rates: {rate_list} req/s ({fractions} x the sweep's highest, "
        f"{peak:.2f} req/s, round 1), {per_rate} Poisson arrivals (the rounds pooled). Predictions: Poisson = mean of "
        f"{args.seeds} simulated runs of as many requests (for TTFT p99 the range over those runs: how far a p99 "
        "of that many requests moves by luck alone); replay = the run's own arrival times and token counts.",
        comparison_table(rows),
        ("Within 20 % on TTFT p50/p99 and throughput (Poisson prediction)." if not doc["misses"] else
         "Beyond 20 % (Poisson prediction): " + "; ".join(doc["misses"])),
        "Other cores: CPU used outside the server and the load generator during each level (a 2-core host). "
        f"During the sweeps' levels (rounds apart by ;): {busy_text}.{left_out}",
        f"Fit and all predictions took {sim_s:.1f} s.",
    ]) + "\n"
    (args.out_dir / "plan_validation.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
