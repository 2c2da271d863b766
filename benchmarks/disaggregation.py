#!/usr/bin/env python3
"""Prefill and decode apart (two instances of one core each, the gateway between) against one instance on both
cores with chunked prefill: the running streams' inter-token latency while long prompts keep arriving.

    .venv/bin/python benchmarks/disaggregation.py                        # smollm2, ~4 minutes on 2 cores
    .venv/bin/python benchmarks/disaggregation.py --duration 15 --streams 2 --out-dir /tmp/pd   # a smoke run

Why: a long prompt's prefill stalls every running stream of its instance for the steps it takes (chunked prefill
caps a step's tokens, so the stall is spread, not removed). Apart, the decode instance never runs a long prompt: it
pulls the prompt's KV from the prefill instance and computes only its last partial block. What that buys (the
streams' ITL p99) and what it costs (half the cores each, the transfer, a gateway hop) is what this measures.

Workload, the same for both layouts: `--streams` requests each decoding `--stream-tokens` tokens after a short prompt,
restarted as they finish, and every `--every` seconds a long prompt (`--long-tokens` tokens of the Lee corpus, a new
one each time) that decodes 16 tokens; for `--duration` seconds, greedy, through the gateway (caches off) for both,
so the hop is in both. Layouts: "one": one `llmserve serve` (both cores, its default chunked prefill); "apart":
`--role prefill` on CPU 0 and `--role decode` on CPU 1, one thread each, the gateway (on both CPUs) sending each
request to the prefill instance, then to the decode instance. The gateway and the client share the cores.
Transfer cost: the decode instance's `llmserve:kv_transfer_seconds` over the blocks it imported.
Writes <out-dir>/disaggregation.{md,json} (default benchmarks/results/disaggregation/<host>-*).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import host_tag  # noqa: E402
from gateway import Proc, scrape  # noqa: E402

from llmserve.evaluate.datasets import perplexity_text  # noqa: E402


def start(layout: str, args: argparse.Namespace) -> list[Proc]:
    """The layout's servers and its gateway (last); their logs and the gateway's config in `args.work_dir`."""
    base = [sys.executable, "-m", "llmserve.cli"]
    serve = [*base, "serve", "--model", args.model, "--no-access-log"]
    procs: list[Proc] = []
    try:
        if layout == "one":
            procs.append(Proc("one", [*serve, "--port", str(args.port + 1)], args.port + 1, args.work_dir))
            route = {"upstreams": [procs[0].url]}
        else:
            for i, role in enumerate(("prefill", "decode")):
                cmd = ["taskset", "-c", str(i), *serve, "--role", role, "--port", str(args.port + 1 + i)]
                procs.append(Proc(role, cmd, args.port + 1 + i, args.work_dir, {"OMP_NUM_THREADS": "1"}))
            route = {"upstreams": [], "prefill": [procs[0].url], "decode": [procs[1].url]}
        config = args.work_dir / f"gateway-{layout}.yaml"
        config.write_text(yaml.safe_dump({"models": {args.model: route}, "cache": {"exact": False}}))
        procs.append(Proc(f"gateway-{layout}", [*base, "gateway", "--config", str(config), "--port", str(args.port),
                                                "--no-access-log"], args.port, args.work_dir))
        return procs
    except BaseException:
        for proc in procs:
            proc.stop()
        raise


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
                 ) -> list[float]:
    """One streamed completion's event arrival times."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def workload(url: str, args: argparse.Namespace, text: list[str]) -> dict[str, Any]:
    """Streams restarted until the end, long prompts every `--every` s; the streams' gaps and the prompts' TTFT."""
    deadline = time.perf_counter() + args.duration
    gaps: list[float] = []
    ttfts: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def decoder(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                times = await stream(session, url, args.model, f"Stream {i}.{n}: " + text[i], args.stream_tokens)
                gaps.extend(b - a for a, b in zip(times[1:], times[2:], strict=False))  # after the first token
                n += 1

        async def long_prompt(k: int) -> None:
            sent = time.perf_counter()
            times = await stream(session, url, args.model, text[100 + k], 16)
            ttfts.append(times[0] - sent)

        async def arrivals() -> None:
            tasks, k = [], 0
            await asyncio.sleep(args.every / 2)
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(long_prompt(k)))
                k += 1
                await asyncio.sleep(args.every)
            await asyncio.gather(*tasks)

        await asyncio.gather(*(decoder(i) for i in range(args.streams)), arrivals())
    gaps.sort()
    return {"itl_p50_ms": 1000 * statistics.median(gaps), "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "itl_max_ms": 1000 * gaps[-1], "stream_tokens": len(gaps), "long_prompts": len(ttfts),
            "long_ttft_p50_s": statistics.median(ttfts), "stream_tok_s": len(gaps) / args.duration}


def prompts(args: argparse.Namespace) -> list[str]:
    """Lee corpus paragraphs joined to about `--long-tokens` tokens each (4 characters a token), one per arrival;
    short ones first for the streams."""
    lines = [line for line in perplexity_text().splitlines() if line.strip()]
    short = [line[:200] for line in lines[:100]]
    joined, out = "", []
    for line in lines[100:]:
        joined += line + " "
        if len(joined) >= 4 * args.long_tokens:
            out.append(joined[: 4 * args.long_tokens])
            joined = ""
    return short + out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    args.out_dir = args.out_dir or REPO / "benchmarks" / "results" / "disaggregation"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir = Path(tempfile.mkdtemp(prefix="llmserve-disaggregation-"))
    print(f"[disaggregation] logs in {args.work_dir}", flush=True)
    text = prompts(args)
    results: dict[str, Any] = {}
    for layout in ("one", "apart"):
        print(f"[disaggregation] {layout}: starting", flush=True)
        procs = start(layout, args)
        try:
            results[layout] = asyncio.run(workload(procs[-1].url, args, text))
            if layout == "apart":
                m = scrape(procs[1].url)
                blocks = m.get("llmserve:kv_transfer_blocks_total", 0.0)
                seconds = m.get("llmserve:kv_transfer_seconds_sum", 0.0)
                results[layout]["transfer_ms_per_block"] = 1000 * seconds / blocks if blocks else None
                results[layout]["blocks_imported"] = blocks
        finally:
            for proc in reversed(procs):
                proc.stop()
        print(f"[disaggregation] {layout}: {results[layout]}", flush=True)
    tag = host_tag()
    record = {"args": vars(args) | {"out_dir": None, "work_dir": None}, "results": results}
    (args.out_dir / f"{tag}-{args.model}.json").write_text(json.dumps(record, indent=1))
    one, apart = results["one"], results["apart"]
    lines = [f"# Prefill/decode apart vs one instance, {args.model}, {tag}", "",
             f"{args.streams} streams of {args.stream_tokens} tokens, a {args.long_tokens}-token prompt every "
             f"{args.every:g} s, {args.duration:g} s; through the gateway in both.", "",
             "| layout | ITL p50 ms | ITL p99 ms | ITL max ms | streams tok/s | long prompts | their TTFT p50 s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in (("one instance, 2 cores, chunked prefill", one), ("prefill + decode, a core each", apart)):
        lines.append(f"| {name} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.1f} | "
                     f"{r['stream_tok_s']:.1f} | {r['long_prompts']} | {r['long_ttft_p50_s']:.2f} |")
    if apart.get("transfer_ms_per_block"):
        lines += ["", f"Transfer: {apart['blocks_imported']:.0f} blocks imported, "
                      f"{apart['transfer_ms_per_block']:.2f} ms a block of 16 tokens (request, bytes, write)."]
    (args.out_dir / f"{tag}-{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
