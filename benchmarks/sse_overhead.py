#!/usr/bin/env python3
"""The server's event-loop CPU per streamed token, at concurrency 1: what SSE streaming costs the model.

Why: the engine thread's decode step and the event loop share the machine's two cores, so every
millisecond the loop spends rendering and sending a chunk is taken from the model. This starts the
real server (`python -m llmserve.cli serve --quantization int4`, i.e. `llmserve serve`), streams N chat
completions one after another (max_tokens 128, ignore_eos, temperature 0) and reads the CPU time of the
server's main thread (the event loop; its thread id is the pid) and of the whole process before and
after each round. Numbers are per generated token; the median of the rounds is reported. CPU times come
from /proc/<pid>/task/<tid>/schedstat (nanoseconds): psutil's per-thread times tick in 10 ms, a tenth of
a whole round's event-loop time here (psutil is the fallback where schedstat is missing).

Comparing code: `--tree LABEL=PATH` (repeatable) runs a server importing llmserve from each PATH (e.g. a
copy of this checkout with the server files of an older commit), all started side by side and measured
in alternating rounds, so load from other work on the machine falls on each alike.

`--fake-engine`: the same server (app, uvicorn, AsyncLLM and its engine thread) with the model replaced
by a stub that sleeps `--step-ms` per step and emits fixed text pieces. The stub takes no CPU, so the
process's CPU is the server's own; useful when other work on the machine makes the model's speed vary.

Usage:
  python benchmarks/sse_overhead.py                                   # this checkout
  python benchmarks/sse_overhead.py --tree before=/tmp/old --tree after=.  --endpoint completions
  python benchmarks/sse_overhead.py --fake-engine --tree before=/tmp/old --tree after=.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

REPO = Path(__file__).resolve().parents[1]
# What the stub engine "generates", one piece per step: words, JSON-escaped characters, non-ASCII.
PIECES = [" The", " sea", " is", " \"deep\"", ",", " and", " wide", ".\n", " Wellen", " é", "🌊", "\t", " 42"]


def start_server(port: int, extra: list[str], fake_step_ms: float | None = None, repo: Path = REPO) -> subprocess.Popen:
    """`llmserve serve` (or the stub-engine server) importing llmserve from `repo`: another checkout or a
    copy of this one holds the code to compare against (its server files from another commit)."""
    if fake_step_ms is None:
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(port), "--quantization", "int4", *extra]
    else:
        cmd = [sys.executable, __file__, "--serve-fake", "--port", str(port), "--step-ms", str(fake_step_ms)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    if repo.resolve() != REPO:  # its own kernel build: one shared cache would be rebuilt by each tree in turn
        env.setdefault("LLMSERVE_KERNEL_CACHE", str(repo / ".kernel-cache"))
    log = Path(tempfile.gettempdir()) / f"sse_overhead-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; its log: {log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server not ready after 300 s")


class _StubEngine:
    """Just what `AsyncLLM` and the server touch of `LLMEngine`: one piece of text per request per step."""

    model_name, max_model_len, dtype = "stub", 4096, "bfloat16"

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.requests: dict[str, list] = {}  # request id -> [params, token ids, text, prompt ids]
        self.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=True: list(range(len(text) // 4 + 1)),
                                         decode=lambda ids: "x" * len(ids))
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.kv_cache = SimpleNamespace(num_blocks=1024, num_free_blocks=1024, usage=0.0,
                                        stats=SimpleNamespace(queries=0, hits=0),
                                        pool=SimpleNamespace(num_cached_blocks=0))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)

    def add_request(self, request_id: str, prompt: list[int], params, cache_salt: str | None = None):
        self.requests[request_id] = [params, [], "", prompt]
        return SimpleNamespace(num_prompt_tokens=len(prompt))

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        from llmserve.outputs import CompletionOutput, RequestOutput

        time.sleep(self.step_s)
        outputs = []
        for request_id, state in list(self.requests.items()):
            params, ids, text, prompt = state
            ids.append(len(ids))
            state[2] = text = text + PIECES[len(ids) % len(PIECES)]
            reason = "length" if len(ids) >= params.max_tokens else None
            if reason:
                del self.requests[request_id]
            now = time.monotonic()
            completion = CompletionOutput(0, text, ids, finish_reason=reason)
            outputs.append(RequestOutput(request_id, None, prompt, [completion], reason is not None,
                                         metrics={"arrival_time": now, "first_token_time": now}))
        return outputs


def serve_fake(port: int, step_ms: float) -> None:
    """The real app and uvicorn set-up of `llmserve serve`, with `_StubEngine` in the engine thread."""
    import uvicorn

    from llmserve.engine.async_engine import AsyncLLM
    from llmserve.server import app as app_module

    class StubLLM(AsyncLLM):
        def _load_and_loop(self, config, log_interval_s, loaded: threading.Event, load_error: list) -> None:
            self.engine = _StubEngine(step_ms / 1e3)
            self._stat_logger = SimpleNamespace(maybe_log=lambda *a: None)
            loaded.set()
            self._loop()

    app_module.AsyncLLM = StubLLM
    app = app_module.create_app(app_module.ServerConfig())
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)).run()


def stream_one(port: int, endpoint: str, max_tokens: int) -> int:
    """One streamed request, read to [DONE] with the stdlib client (cheap on the shared cores);
    returns the completion tokens the usage chunk reports."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Tell me about the sea."}]
    else:
        path, body["prompt"] = "/v1/completions", "The history of the sea is"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    last = b""
    for line in response:
        if line.startswith(b"data: {"):
            last = line
        elif line.startswith(b"data: [DONE]"):
            break
    conn.close()
    return json.loads(last[6:])["usage"]["completion_tokens"]


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """(main thread, whole process) CPU seconds so far: schedstat's ns where readable, else psutil's ticks."""
    try:
        per_thread = {}
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
                per_thread[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        return per_thread[proc.pid], sum(per_thread.values())
    except OSError:
        main = next(t for t in proc.threads() if t.id == proc.pid)
        return main.user_time + main.system_time, sum(proc.cpu_times()[:2])


def one_round(proc: psutil.Process, port: int, endpoint: str, requests: int, max_tokens: int) -> dict[str, float]:
    main0, total0 = cpu_seconds(proc)
    t0 = time.perf_counter()
    tokens = sum(stream_one(port, endpoint, max_tokens) for _ in range(requests))
    wall = time.perf_counter() - t0
    main1, total1 = cpu_seconds(proc)
    return {"main_ms_per_tok": (main1 - main0) * 1e3 / tokens, "proc_ms_per_tok": (total1 - total0) * 1e3 / tokens,
            "wall_ms_per_tok": wall * 1e3 / tokens, "tok_s": tokens / wall}


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median of `args.repeats` rounds per tree; the trees' rounds alternate."""
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"current": str(REPO)}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    try:
        for i, (label, path) in enumerate(trees.items()):
            port = args.port + i
            fake_step_ms = args.step_ms if args.fake_engine else None
            servers[label] = start_server(port, args.server_args, fake_step_ms, Path(path).resolve()), port
            stream_one(port, args.endpoint, 16)  # warm-up: first-request costs stay out of the rounds
        for _ in range(args.repeats):
            for label, (server, port) in servers.items():
                r = one_round(psutil.Process(server.pid), port, args.endpoint, args.requests, args.max_tokens)
                print(f"  {label}: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), file=sys.stderr)
                rounds[label].append(r)
    finally:
        for server, _ in servers.values():
            server.terminate()
        for server, _ in servers.values():
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in rounds.items()}


def table(results: dict[str, dict[str, float]]) -> str:
    rows = ["| run | main-thread CPU ms/token | process CPU ms/token | wall ms/token | tokens/s |",
            "|---|---:|---:|---:|---:|"]
    for label, r in results.items():
        rows.append(f"| {label} | {r['main_ms_per_tok']:.3f} | {r['proc_ms_per_tok']:.3f} | "
                    f"{r['wall_ms_per_tok']:.3f} | {r['tok_s']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tree", action="append", metavar="LABEL=PATH",
                        help="a tree to import llmserve from (repeatable; default: this checkout)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--requests", type=int, default=6, help="streams per round, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per tree; the median is reported")
    parser.add_argument("--port", type=int, default=8123, help="the first tree's; the next ones count up")
    parser.add_argument("--fake-engine", action="store_true", help="a stub model that sleeps --step-ms a step")
    parser.add_argument("--step-ms", type=float, default=4.1)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)  # the server side of it
    parser.add_argument("server_args", nargs="*", help="extra `llmserve serve` flags (after --)")
    args = parser.parse_args()
    if args.serve_fake:
        return serve_fake(args.port, args.step_ms)
    results = measure(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    engine = f"stub engine, {args.step_ms} ms steps" if args.fake_engine else "smollm2-135m int4"
    print(f"{args.endpoint}, {engine}, {os.cpu_count()} CPUs; median of {args.repeats} rounds of "
          f"{args.requests} x {args.max_tokens} tokens")
    print(table(results))


if __name__ == "__main__":
    main()
