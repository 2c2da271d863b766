#!/usr/bin/env python3
"""The gateway under a long mixed load while its parts fail: does every request that had not started streaming
still get its answer, does nothing leak?

    .venv/bin/python benchmarks/gateway_soak.py                      # 30 minutes, 32 clients
    .venv/bin/python benchmarks/gateway_soak.py --minutes 1 --smoke  # a smoke run

Two `llmserve serve` replicas of the default model (one thread each), a gateway in front of them with keys, the
exact and semantic caches on a real redis-server, and 32 clients that loop over a mix of requests: streamed and
not, greedy (cacheable) and sampled, short and long; one stream in ten is dropped by its client mid-way; a 429 or
503 with `Retry-After` is waited out and retried, as a well-behaved client does. During the run:

    at 1/4   redis-server is stopped (SIGTERM) for a minute, then started again on the same port
    at 1/2   one replica is killed with SIGKILL, then started again on the same port

Every 10 s it samples the resident memory of the gateway and the replicas, the gateway's outstanding-request
count per replica and the replicas' KV usage. At the end (idle) it checks that the outstanding counts and KV usage
are back to 0. A request *failed before streaming* is an error status (or a broken connection) before its first
byte; *broken mid-stream* is a stream that ended with an error event after its first one (only streams on the
killed replica should). Writes <out-dir>/soak.md, soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import machine_facts  # noqa: E402
from gateway import MODEL, Proc, replica, scrape  # noqa: E402

KEYS = ("soak-team-a", "soak-team-b")
ADMIN = "soak-admin"
TOPICS = ["the moon", "volcanoes", "the Roman empire", "honey bees", "rainbows", "glaciers", "the printing press",
          "coral reefs", "comets", "the Silk Road", "owls", "tides", "bread", "lightning", "penguins", "deserts"]
FORMS = ["Tell me one fact about {}.", "Give me a short fact about {}.", "Write two sentences about {}.",
         "Explain {} to a child in one sentence."]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    retry_after_waits: int = 0
    mid_stream: list[dict[str, Any]] = field(default_factory=list)  # what broken streams received, and when
    done_at: list[float] = field(default_factory=list)


def request_body(rng: random.Random) -> tuple[dict[str, Any], bool]:
    topic, form = rng.choice(TOPICS), rng.choice(FORMS)
    stream = rng.random() < 0.5
    body = {"model": MODEL, "messages": [{"role": "user", "content": form.format(topic)}],
            "max_tokens": rng.choice((16, 32, 64, 96)), "stream": stream,
            "temperature": 0 if rng.random() < 0.7 else 0.8}
    return body, stream


async def one(client: httpx.AsyncClient, url: str, key: str, rng: random.Random, tally: Tally, start: float) -> None:
    body, stream = request_body(rng)
    drop_after = rng.randint(1, 6) if stream and rng.random() < 0.1 else None
    headers = {"Authorization": f"Bearer {key}"}
    for _ in range(20):  # Retry-After honoured
        try:
            if not stream:
                r = await client.post(url, json=body, headers=headers)
                tally.statuses[r.status_code] += 1
                if r.status_code in (429, 503) and "retry-after" in r.headers:
                    tally.retry_after_waits += 1
                    await asyncio.sleep(float(r.headers["retry-after"]))
                    continue
                tally.outcomes["ok" if r.status_code == 200 and r.json()["choices"] else "failed_before_stream"] += 1
                break
            async with client.stream("POST", url, json=body, headers=headers) as r:
                tally.statuses[r.status_code] += 1
                if r.status_code in (429, 503) and "retry-after" in r.headers:
                    await r.aread()
                    tally.retry_after_waits += 1
                    await asyncio.sleep(float(r.headers["retry-after"]))
                    continue
                if r.status_code != 200:
                    await r.aread()
                    tally.outcomes["failed_before_stream"] += 1
                    break
                events, error = 0, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line.startswith("data: [DONE]"):
                        break
                    events += 1
                    if '"error"' in line:
                        error = json.loads(line[6:])["error"]
                    if drop_after is not None and events >= drop_after:
                        break  # the client hangs up mid-stream
                if drop_after is not None and events >= drop_after:
                    tally.outcomes["dropped_by_client"] += 1
                elif error is not None:
                    tally.outcomes["broken_mid_stream"] += 1
                    tally.mid_stream.append({"t": round(time.monotonic() - start, 1), "events": events,
                                             "error": error.get("message", "")[:120]})
                else:
                    tally.outcomes["ok"] += 1
                break
        except httpx.HTTPError as e:  # a connection the gateway broke: before the first byte, a failure
            tally.outcomes["failed_before_stream" if not stream else "broken_connection"] += 1
            tally.mid_stream.append({"t": round(time.monotonic() - start, 1), "error": type(e).__name__})
            break
    else:
        tally.outcomes["gave_up_after_retries"] += 1
    tally.done_at.append(time.monotonic() - start)


async def clients(url: str, n: int, seconds: float, tally: Tally, start: float) -> None:
    async def loop(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            while time.monotonic() - start < seconds:
                await one(client, url, KEYS[i % 2], rng, tally, start)

    await asyncio.gather(*(loop(i) for i in range(n)))


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (a replica's engine may live in a child)."""
    total = 0.0
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                   text=True).stdout.split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def scrape_admin(url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(request, timeout=30).read().decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Redis:
    def __init__(self, port: int, out_dir: Path) -> None:
        self.port, self.out_dir, self.proc = port, out_dir, None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
                                     stdout=(self.out_dir / "soak_redis.log").open("a"), stderr=subprocess.STDOUT)
        time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out, port = args.out_dir, args.port
    seconds = args.minutes * 60
    redis = Redis(port + 3, out)
    redis.start()
    flags = ("--max-model-len", "1024")
    replicas = [replica(f"soak_replica{i}", port + 1 + i, args, threads=1, flags=flags) for i in range(2)]
    config = {"models": {MODEL: {"upstreams": [r.url for r in replicas]}},
              "keys": [{"key": k} for k in KEYS], "admin_key": ADMIN,
              "cache": {"redis_url": f"redis://127.0.0.1:{port + 3}/0", "semantic": True}}
    (out / "soak_gateway.yaml").write_text(yaml.safe_dump(config))
    gw = Proc("soak_gateway", [sys.executable, "-m", "llmserve.cli", "gateway", "--config",
                               str(out / "soak_gateway.yaml"), "--port", str(port), "--no-access-log"], port, out)
    tally, samples, events = Tally(), [], []
    start = time.monotonic()

    def sample() -> None:
        m = scrape_admin(gw.url)
        samples.append({"t": round(time.monotonic() - start, 1), "gateway_rss_mb": round(rss_mb(gw.proc.pid), 1),
                        "replica_rss_mb": [round(rss_mb(r.proc.pid), 1) for r in replicas],
                        "outstanding": m.get("llmserve:gateway_replica_outstanding_requests", 0.0),
                        "kv_usage": [_kv(r.url) for r in replicas], "completed": len(tally.done_at)})

    async def chaos() -> None:
        await asyncio.sleep(seconds / 4)
        events.append({"t": round(time.monotonic() - start, 1), "event": "redis stopped"})
        redis.stop()
        await asyncio.sleep(min(60.0, seconds / 8))
        redis.start()
        events.append({"t": round(time.monotonic() - start, 1), "event": "redis started"})
        await asyncio.sleep(max(0.0, seconds / 2 - (time.monotonic() - start)))
        victim = replicas[1]
        events.append({"t": round(time.monotonic() - start, 1), "event": "replica 1 killed (SIGKILL)"})
        victim.proc.kill()
        victim.proc.wait()
        victim.log.close()
        replicas[1] = await asyncio.to_thread(replica, "soak_replica1_restarted", victim.port, args, 1, flags)
        events.append({"t": round(time.monotonic() - start, 1), "event": "replica 1 ready again"})

    async def sampler() -> None:
        while time.monotonic() - start < seconds:
            await asyncio.to_thread(sample)
            print(f"[soak] {samples[-1]['t']:.0f}s: {samples[-1]['completed']} done, outstanding "
                  f"{samples[-1]['outstanding']:.0f}, gateway {samples[-1]['gateway_rss_mb']:.0f} MB, "
                  f"{dict(tally.outcomes)}", flush=True)
            await asyncio.sleep(args.sample_every)

    try:
        await asyncio.gather(clients(f"{gw.url}/v1/chat/completions", args.concurrency, seconds, tally, start),
                             chaos(), sampler())
        await asyncio.sleep(3)  # idle: the last aborted upstream requests unwind
        sample()
        end = samples[-1]
    finally:
        gw.stop()
        for r in replicas:
            r.stop()
        redis.stop()
    five = next((s for s in samples if s["t"] >= min(300.0, seconds / 6)), samples[0])
    growth = {"gateway": end["gateway_rss_mb"] / five["gateway_rss_mb"] - 1,
              "replica0 (never killed)": end["replica_rss_mb"][0] / five["replica_rss_mb"][0] - 1}
    return {"minutes": args.minutes, "concurrency": args.concurrency, "machine": machine_facts(),
            "outcomes": dict(tally.outcomes), "statuses": {str(k): v for k, v in tally.statuses.items()},
            "retry_after_waits": tally.retry_after_waits, "broken_streams": tally.mid_stream, "events": events,
            "end": end, "rss_growth_after_warmup": growth, "rss_reference_t": five["t"], "samples": samples}


def _kv(url: str) -> float:
    try:
        return round(scrape(url).get("llmserve:kv_cache_usage_perc", 0.0), 4)
    except OSError:
        return -1.0  # not answering (the killed replica)


def report(result: dict[str, Any]) -> str:
    o, end = result["outcomes"], result["end"]
    total = sum(o.values())
    lines = [f"{result['minutes']} minutes, {result['concurrency']} clients; {result['machine']['cpu']}, "
             f"{result['machine']['cpus']} CPUs.", "",
             "| outcome | requests |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(o.items())] + [f"| total | {total} |", ""]
    lines += [f"- HTTP statuses: {result['statuses']}; Retry-After waits: {result['retry_after_waits']}",
              "- events: " + "; ".join(f"{e['event']} at {e['t']} s" for e in result["events"]),
              f"- at the end (idle): outstanding {end['outstanding']:.0f}, KV usage {end['kv_usage']}",
              "- resident memory growth from t = {:.0f} s to the end: ".format(result["rss_reference_t"])
              + ", ".join(f"{k} {v * 100:+.1f} %" for k, v in result["rss_growth_after_warmup"].items()),
              f"- streams broken after their first event ({len(result['broken_streams'])}): "
              + "; ".join(f"t={b['t']} s {b.get('events', '?')} events, {b['error']}"
                          for b in result["broken_streams"][:12])]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [x["gateway_rss_mb"] for x in s], label="gateway")
    for i in range(2):
        ax1.plot(t, [x["replica_rss_mb"][i] for x in s], label=f"replica {i}")
    ax1.set_ylabel("resident MB")
    ax1.legend()
    done = [x["completed"] for x in s]
    ax2.plot(t[1:], [(b - a) / max(1e-9, (tb - ta) * 60) for a, b, ta, tb in zip(done, done[1:], t, t[1:],
                                                                                 strict=False)], label="requests/s")
    ax2.plot(t, [x["outstanding"] for x in s], label="outstanding at the gateway")
    ax2.set_xlabel("minutes")
    ax2.legend()
    for e in result["events"]:
        for ax in (ax1, ax2):
            ax.axvline(e["t"] / 60, color="grey", linestyle=":")
        ax1.annotate(e["event"], (e["t"] / 60, ax1.get_ylim()[1]), rotation=90, va="top", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--port", type=int, default=8070, help="the gateway's; replicas take the next two, redis the third")
    ap.add_argument("--smoke", action="store_true", help="a short run with few clients: figures meaningless")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "gateway")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.sample_every = min(args.concurrency, 4), 2.0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    (args.out_dir / "soak.json").write_text(json.dumps(result, indent=1))
    body = report(result)
    (args.out_dir / "soak.md").write_text(f"# Gateway soak\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} by "
                                          f"`benchmarks/gateway_soak.py --minutes {args.minutes:g}`.\n\n{body}\n")
    plot(result, args.out_dir / "soak.png")
    print(body, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
