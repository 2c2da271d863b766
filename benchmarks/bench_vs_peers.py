#!/usr/bin/env python3
"""llmserve against the reference ("peer") servers, vLLM-CPU and llama.cpp's llama-server, measured by one client.

    python benchmarks/bench_vs_peers.py                       # every engine installed under $PEERS, SmolLM2
    python benchmarks/bench_vs_peers.py --model qwen2.5-coder-1.5b --engines llmserve,llama-server-np32,vllm-cpu-2thr
    python benchmarks/bench_vs_peers.py --engines default,compile --llmserve-variant default= \
        --llmserve-variant "compile=--compile" --recorded none     # llmserve's flags against its default
    python benchmarks/bench_vs_peers.py --report-only             # the table and plot from an earlier run's files
    python benchmarks/bench_vs_peers.py --dry-run                 # what would run, what is skipped
    python benchmarks/bench_vs_peers.py --engines llmserve --levels 1:2 --warmup 0 --no-recorded \
        --out-dir /tmp/peers                                       # a smoke run: llmserve alone, two requests

Why: "how fast is it" only means something beside the servers people would otherwise run, on the same cores,
the same model file and the same workload. docs/performance.md, "Served against llama.cpp and vLLM-CPU", has the
figures; the same script compares llmserve's own flag sets (--llmserve-variant) for "The default configuration".

Each server is started the way the peers' harness starts it (shared/peers/servers/*.sh, one at a time, on this
machine's cores), waited for, driven by `llmserve bench`, and stopped; its peak RSS (the process tree, sampled
every 0.5 s) and its time to ready are recorded. The workload (the default `peers` style, mirroring the harness's
loadgen.py): seed 1234, a shared ~205-token system prompt + a distinct user question per request, padded so the
chat-templated prompt is 256 tokens (exact with the model's tokenizer, its HF directory under $PEERS/models),
max_tokens 128, temperature 0, ignore_eos (llama-cpp-python: EOS blocked by logit_bias instead), 2 sequential
warm-up requests, closed-loop levels 1:8, 8:32, 32:64 (concurrency:requests), a fresh connection per request.
`--model` gives every engine the same model: llmserve its registered name, llama-server the GGUF as shipped, vLLM
the bf16 HF directory converted from it (shared/peers/README.md says how to set up $PEERS).

Engines that are not installed under $PEERS (default ~/peers) are skipped and said so; for SmolLM2 the harness's
own recorded results (shared/peers/results/*.json) are then shown instead, marked "recorded" (another machine's:
compare within one source only). Note: the harness's ITL is per stream chunk, `llmserve bench`'s per token (a
2-token chunk's gap is split in two); TPOT is comparable.
Writes <out-dir>/<engine>.json, peers_comparison.md and peers_comparison.png (default out dir:
benchmarks/results/served-<model>/<host>/). Exit status 1 only if an engine that is available could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from llmserve.bench.report import (  # noqa: E402 - after the sys.path fix-up for direct runs
    compare_table,
    load_result,
    render_table,
)

PEERS = Path(os.environ.get("PEERS", os.path.expanduser("~/peers")))
DEFAULT_LLMSERVE_CMD = ("{python} -m llmserve.cli serve --model {model} --served-model-name {name} "
                        "--host 127.0.0.1 --port {port} --no-access-log")


@dataclass(frozen=True)
class PeerModel:
    """One model every engine can serve: the GGUF as shipped (llama.cpp), its HF conversion (vLLM, naive
    HF, the workload's tokenizer) and llmserve's registered name, all served under one model name.
    peerbench's scripts serve SmolLM2; they pass extra arguments on, and a later `--model` wins, so
    `Engine.model_args` points them at another model without editing them."""

    name: str  # served model name = llmserve's registered name
    title: str
    gguf: str  # under $PEERS
    hf_dir: str  # under $PEERS (shared/peers/convert_gguf_to_hf.py writes it)
    end_of_turn_id: int  # <|im_end|>, blocked by logit_bias where a server has no ignore_eos


MODELS = {m.name: m for m in (
    PeerModel("smollm2", "SmolLM2-135M-Instruct", "models/SmolLM2-135M-Instruct.Q4_1.gguf",
              "models/smollm2-135m-hf", 2),
    PeerModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
              "models/qwen2.5-coder-0.5b-hf", 151645),
    PeerModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "models/qwen2.5-coder-1.5b-hf", 151645),
)}
# placeholders in Engine.needs, model_args and bench_args (with "{name}"), filled in by `fill`
GGUF, MODEL_DIR, END_OF_TURN = "{gguf}", "{hf_dir}", "{end_of_turn}"
LEVELS = "1:8,8:32,32:64"
QUICK_LEVELS = "1:4,4:8"


@dataclass
class Engine:
    """One server to measure: how to start it, what it needs, how to drive it."""

    name: str
    port: int
    script: str | None = None  # peerbench servers/*.sh, relative to shared/peers
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # paths under $PEERS that must exist
    model_args: tuple[str, ...] = ()  # appended to the script: which model to serve, under which name
    ready_path: str = "/v1/models"
    ask_model: bool = False  # True: let `llmserve bench` ask GET /v1/models for the name
    bench_args: tuple[str, ...] = ()
    serve_flags: str = ""  # llmserve variants: flags appended to --llmserve-cmd


_VLLM_MODEL = ("--model", MODEL_DIR, "--served-model-name", "{name}")
PEER_ENGINES = (
    Engine("vllm-cpu", 8001, "servers/vllm.sh", needs=("venv-vllm/bin/python", MODEL_DIR), model_args=_VLLM_MODEL),
    Engine("vllm-cpu-2thr", 8001, "servers/vllm.sh",
           env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
           needs=("venv-vllm/bin/python", MODEL_DIR), model_args=_VLLM_MODEL),
    Engine("llama-server-np32", 8004, "servers/llama_server.sh", env={"NP": "32"},
           needs=("build/llamacpp-noamx/bin/llama-server", GGUF), ready_path="/health",
           model_args=("-m", GGUF, "--alias", "{name}")),
    Engine("llama-cpp-python", 8002, "servers/llamacpp_python.sh",
           needs=("venv-llamacpp/bin/python", "build/llamacpp-noamx/bin", GGUF),
           model_args=("--model", GGUF, "--model_alias", "{name}"),
           bench_args=("--no-ignore-eos", "--extra-body", json.dumps({"logit_bias": {END_OF_TURN: -100}}))),
    Engine("naive-hf", 8003, "servers/naive_hf.sh", needs=("venv-hf/bin/python", MODEL_DIR),
           model_args=("--model", MODEL_DIR, "--served-model-name", "{name}")),
)


def find_shared_peers() -> Path | None:
    for cand in (REPO / "shared" / "peers", REPO.parent / "shared" / "peers", Path("/work/shared/peers")):
        if (cand / "README.md").is_file():
            return cand
    return None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class TreeMemory(threading.Thread):
    """Peak RSS of the server's whole process tree (psutil), sampled every 0.5 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_rss = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        while not self.stop_event.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.stop_event.wait(0.5)


def fill(text: str, model: PeerModel, root: Path = Path()) -> str:
    """An engine's needs, model_args or bench_args for this model: the placeholders replaced (not
    `str.format`: bench_args hold JSON), paths under `root`."""
    for key, value in ((GGUF, root / model.gguf), (MODEL_DIR, root / model.hf_dir), ("{name}", model.name),
                       (END_OF_TURN, model.end_of_turn_id)):
        text = text.replace(key, str(value))
    return text


def why_unavailable(engine: Engine, args: argparse.Namespace, shared: Path | None) -> str | None:
    if engine.script is None:  # llmserve or a variant of it: it loads the model by its registered name
        return None
    if shared is None or engine.script is None or not (shared / engine.script).is_file():
        return "peerbench server scripts (shared/peers/servers) not found"
    missing = [n for n in (fill(need, args.model) for need in engine.needs) if not (args.peers / n).exists()]
    if missing:
        return f"not installed under {args.peers}: missing {', '.join(missing)}"
    return None


def start_command(engine: Engine, args: argparse.Namespace, shared: Path | None) -> str:
    if engine.script is None:  # llmserve or a variant of it
        cmd = args.llmserve_cmd.format(python=shlex.quote(sys.executable), port=engine.port,
                                       model=shlex.quote(args.model.name), name=shlex.quote(args.model.name))
        return f"{cmd} {engine.serve_flags}".strip()
    assert shared is not None and engine.script is not None
    return shlex.join([str(shared / engine.script), *(fill(a, args.model, args.peers) for a in engine.model_args)])


def parse_levels(text: str) -> list[tuple[int, int]]:
    """'1:8,8:32' -> [(1, 8), (8, 32)] (concurrency, requests)."""
    out = []
    for part in text.split(","):
        c, sep, n = part.strip().partition(":")
        if not sep or not c.isdigit() or not n.isdigit() or int(c) < 1 or int(n) < 1:
            raise ValueError(f"bad level {part!r}: use concurrency:requests like 8:32")
        out.append((int(c), int(n)))
    return out


def levels_for(engine_name: str, args: argparse.Namespace) -> str:
    return args.engine_levels.get(engine_name, args.levels)


def bench_command(engine: Engine, args: argparse.Namespace, out: Path) -> list[str]:
    levels = parse_levels(levels_for(engine.name, args))
    conc = ",".join(str(c) for c, _ in levels)
    nreq = ",".join(str(n) for _, n in levels)
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", f"http://127.0.0.1:{engine.port}",
           "--workload", "shared-prefix", "--prefix-len", "200", "--input-len", "256", "--output-len", "128",
           "--seed", "1234", "--temperature", "0", "--concurrency", conc, "--num-requests", nreq,
           "--warmup", str(args.warmup), "--request-timeout", str(args.request_timeout),
           "--label", engine.name, "--out", str(out), "--no-progress"]
    tokenizer = args.tokenizer or (args.peers / args.model.hf_dir)
    if Path(tokenizer).exists():
        cmd += ["--tokenizer", str(tokenizer)]
    if not engine.ask_model:
        cmd += ["--model", args.model.name]
    return cmd + [fill(a, args.model) for a in engine.bench_args]


def stop_group(proc: subprocess.Popen[bytes], pgid: int) -> None:
    """Stop the server we started: SIGTERM to its own process group, SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def measure(engine: Engine, args: argparse.Namespace, shared: Path | None) -> dict[str, Any]:
    """Start, wait until ready, run `llmserve bench`, stop. Returns facts; the result JSON is on disk."""
    out = args.out_dir / f"{engine.name}.json"
    log = args.out_dir / f"{engine.name}.server.log"
    if not port_free(engine.port):
        return {"ok": False, "reason": f"port {engine.port} is busy; refusing to start a second server"}
    env = {**os.environ, **engine.env, "PORT": str(engine.port), "PEERS": str(args.peers)}
    cmd = start_command(engine, args, shared)
    print(f"[peers] {engine.name}: starting: {cmd}", flush=True)
    t0 = time.time()
    with log.open("w") as logf:
        proc = subprocess.Popen(cmd, shell=True, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    pgid = os.getpgid(proc.pid)
    mem = TreeMemory(proc.pid)
    mem.start()
    facts: dict[str, Any] = {"cmd": cmd, "log": str(log), "levels": levels_for(engine.name, args)}
    try:
        ready_url = f"http://127.0.0.1:{engine.port}{engine.ready_path}"
        startup = None
        while time.time() - t0 < args.ready_timeout:
            if proc.poll() is not None:
                return {**facts, "ok": False, "reason": f"server exited with {proc.returncode}; see {log}"}
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as r:
                    if r.status == 200:
                        startup = time.time() - t0
                        break
            except OSError:
                pass
            time.sleep(0.25)
        if startup is None:
            return {**facts, "ok": False, "reason": f"not ready after {args.ready_timeout:g} s; see {log}"}
        print(f"[peers] {engine.name}: ready after {startup:.1f} s", flush=True)
        bcmd = bench_command(engine, args, out)
        t_bench = time.time()
        rc = subprocess.call(bcmd, cwd=REPO)
        facts.update(startup_to_ready_s=round(startup, 2), bench_wall_s=round(time.time() - t_bench, 1),
                     bench_rc=rc, bench_cmd=bcmd)
    finally:
        mem.stop_event.set()
        stop_group(proc, pgid)
    facts["peak_tree_rss_mib"] = round(mem.peak_rss / 2**20, 1)
    if not out.is_file():
        reason = f"`llmserve bench` wrote no results (rc {facts.get('bench_rc')})"
        return {**facts, "ok": False, "reason": reason}
    doc = json.loads(out.read_text())
    doc.setdefault("server", {}).update({k: v for k, v in facts.items() if k != "bench_cmd"})
    out.write_text(json.dumps(doc, indent=1))
    return {**facts, "ok": True, "out": str(out)}


def machine_facts() -> dict[str, Any]:
    """CPU model, core count and the ISA flags that decide bf16 speed (AMX, AVX512-BF16), from /proc/cpuinfo."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model in ("?", "", "x86_64"):
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "amx": any(f.startswith("amx") for f in flags),
            "avx512_bf16": "avx512_bf16" in flags, "avx512f": "avx512f" in flags}


def host_tag() -> str:
    """A short name for this machine's host type, under which its latest results are kept (docs/performance.md,
    "Hosts"): intel-amx, zen5, zen4, ..., from /proc/cpuinfo's vendor, family and flags."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            info.setdefault(key.strip(), val.strip())
    except OSError:
        return platform.machine() or "host"
    flags, family = set(info.get("flags", "").split()), int(info.get("cpu family", "0") or 0)
    if info.get("vendor_id") == "AuthenticAMD":
        model = int(info.get("model", "0") or 0)
        return {26: "zen5", 25: "zen4" if "avx512f" in flags else "zen3",
                23: "zen2" if model >= 0x30 else "zen1"}.get(family, f"amd-family{family}")
    if info.get("vendor_id") == "GenuineIntel":
        return "intel-amx" if "amx_int8" in flags else "intel-avx512" if "avx512f" in flags else "intel"
    return platform.machine() or "host"


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown_report(rows: list[tuple[str, str, dict[str, Any]]], skipped: dict[str, str], levels: str,
                    engine_levels: dict[str, str] | None = None, title: str = MODELS["smollm2"].title) -> str:
    """rows: (engine label, source, result doc)."""
    headers = ["engine", "source", "conc", "ok/n", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
               "ITL p99", "TPOT p50", "TPOT p99", "start s", "peak RSS MiB"]
    table = []
    for label, source, doc in rows:
        srv = doc.get("server", {})
        for i, s in enumerate(doc.get("summary", [])):
            table.append([label if i == 0 else "", source if i == 0 else "", str(s.get("concurrency", "-")),
                          f"{s.get('num_ok')}/{s.get('num_requests')}", _f(s.get("output_tok_per_s")),
                          _f(s.get("req_per_s"), 2), _f(s.get("ttft_p50_ms"), 0), _f(s.get("ttft_p99_ms"), 0),
                          _f(s.get("itl_p50_ms")), _f(s.get("itl_p99_ms")), _f(s.get("tpot_p50_ms")),
                          _f(s.get("tpot_p99_ms")),
                          _f(srv.get("startup_to_ready_s")) if i == 0 else "",
                          _f(srv.get("peak_tree_rss_mib"), 0) if i == 0 else ""])
    m = machine_facts()
    stamps = sorted(time.strftime("%Y-%m-%d %H:%M", time.localtime(doc["started_unix"]))
                    for _, src, doc in rows if src == "measured" and doc.get("started_unix"))
    measured_when = f" (runs started {stamps[0]} to {stamps[-1]})" if stamps else ""
    overrides = "".join(f"; {k}: {v}" for k, v in (engine_levels or {}).items()
                        if any(lab == k and src == "measured" for lab, src, _ in rows))
    machine = (f"This machine: {m['cpu']}, {m['cpus']} CPUs, AMX {'yes' if m['amx'] else 'no'}, AVX512-BF16 "
               f"{'yes' if m['avx512_bf16'] else 'no'}.")
    parts = [
        f"# llmserve vs peers ({title}, CPU)",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by `benchmarks/bench_vs_peers.py`. Workload: shared "
        f"~205-token system prompt, 256 prompt tokens, 128 output tokens (ignore_eos), levels {levels}"
        f"{overrides} (concurrency:requests), times in ms. 'measured' rows were measured on this machine with "
        f"`llmserve bench`{measured_when}. " + machine,
        render_table(headers, table, markdown=True, left=2),
    ]
    if any(src.startswith("recorded") for _, src, _ in rows):
        parts.append(
            "**'recorded' rows were NOT measured here**: they are peerbench's own runs "
            "(shared/peers/results/*.json, its loadgen.py, whose ITL is per stream chunk, not per token), made "
            "on peerbench's machine, which reported AVX-512, AVX512-BF16 and AMX-BF16/INT8 (shared/peers/README.md). "
            + ("This machine has no AMX, so bf16 matrix products run at a different speed: recorded and "
               "measured numbers are not directly comparable; compare within one source only."
               if not m["amx"] else
               "Even on a similar CPU, a different machine's numbers are only roughly comparable.")
            + " An engine measured here and also shown as recorded gives the speed ratio of the two machines "
            "for that engine.")
    if skipped:
        parts.append("Skipped:\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in skipped.items()))
    measured = [(lab, doc) for lab, src, doc in rows if src == "measured"]
    if len(rows) >= 2 and rows[0][0] == "llmserve":
        docs = [{**doc, "engine": f"{lab} ({src})"} for lab, src, doc in rows]
        parts.append("## Ratios to llmserve (a)\n\n" + compare_table(docs, markdown=True))
    elif not measured:
        parts.append("Nothing was measured in this run (see Skipped).")
    return "\n\n".join(parts) + "\n"


def plot_comparison(rows: list[tuple[str, str, dict[str, Any]]], path: Path,
                    model_title: str = MODELS["smollm2"].title) -> None:
    """PNG: output tok/s, TTFT p50 (log) and TPOT p50 vs concurrency; one colour per engine, measured rows
    solid and thick, recorded ones (another machine) thin, dashed and faded; one legend under the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    elsewhere = "recorded on another machine" if not machine_facts()["amx"] else "recorded"  # peerbench's had AMX
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    panels = (("output_tok_per_s", "output throughput (tok/s, higher is better)"),
              ("ttft_p50_ms", "TTFT p50 (ms, log scale, lower is better)"),
              ("tpot_p50_ms", "TPOT p50 (ms per output token, lower is better)"))
    ticks: set[int] = set()
    for i, (label, src, doc) in enumerate(rows):
        measured = src == "measured"
        summaries = [s for s in doc.get("summary", []) if s.get("concurrency")]
        xs = [int(s["concurrency"]) for s in summaries]
        ticks.update(xs)
        for ax, (key, _title) in zip(axes, panels, strict=True):
            pts = [(x, s.get(key)) for x, s in zip(xs, summaries, strict=True) if s.get(key) is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-" if measured else "s--", color=f"C{i}",
                    lw=2.6 if measured else 1.3, alpha=1.0 if measured else 0.55, ms=7 if measured else 5,
                    label=f"{label} ({'measured here' if measured else elsewhere})")
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if key == "ttft_p50_ms":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"{model_title} on 2 CPU cores: 256 prompt + 128 output tokens per request; "
                 "dashed = not measured here", fontsize=11)
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llmserve," + ",".join(e.name for e in PEER_ENGINES),
                    help="comma list (default: llmserve and every peer)")
    ap.add_argument("--peers-dir", dest="peers", type=Path, default=PEERS, help="default $PEERS or ~/peers")
    ap.add_argument("--shared-peers", type=Path, default=None, help="peerbench dir (default: found)")
    ap.add_argument("--llmserve-cmd", default=DEFAULT_LLMSERVE_CMD,
                    help="start line for llmserve; {python}, {port}, {model} are filled in "
                         "(default %(default)r)")
    ap.add_argument("--llmserve-port", type=int, default=8010)
    ap.add_argument("--llmserve-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more llmserve engine, started with these extra serve flags, e.g. "
                         "'llmserve-int4=--quantization int4 --compile'; name it in --engines (repeatable)")
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS),
                    help="the model every engine serves (default %(default)s); a peer needs its GGUF and HF "
                         "directory under $PEERS (shared/peers/README.md says how), llmserve its registered name")
    ap.add_argument("--tokenizer", default=None, help="default the model's HF directory under $PEERS")
    ap.add_argument("--levels", default=LEVELS, help="concurrency:requests,... (default %(default)s)")
    ap.add_argument("--engine-levels", action="append", default=[], metavar="ENGINE=LEVELS",
                    help="levels for one engine instead of --levels, e.g. naive-hf=1:4,8:16,32:32 for a server "
                         "that runs one request at a time (repeatable)")
    ap.add_argument("--quick", action="store_true", help=f"levels {QUICK_LEVELS}, 1 warm-up (smoke test)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--recorded", choices=("absent", "all", "none"), default="absent",
                    help="peerbench's recorded results to show: for engines not measured here (absent, the "
                         "default), for every engine asked for (all: measured ones too, as a cross-machine "
                         "reference), or none")
    ap.add_argument("--no-recorded", dest="recorded", action="store_const", const="none",
                    help="the same as --recorded none")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default benchmarks/results/served-<model>/<host> (served-smollm2, served-qwen1.5b, ...)")
    ap.add_argument("--dry-run", action="store_true", help="only say what would run and what is skipped")
    ap.add_argument("--report-only", action="store_true",
                    help="start nothing: rebuild the markdown and the plot from the <out-dir>/<engine>.json files "
                         "of an earlier run")
    args = ap.parse_args(argv)
    if args.quick:
        args.levels, args.warmup = QUICK_LEVELS, min(args.warmup, 1)
    args.model = MODELS[args.model]
    if args.out_dir is None:
        short = {"smollm2": "smollm2", "qwen2.5-coder-0.5b": "qwen0.5b", "qwen2.5-coder-1.5b": "qwen1.5b"}
        args.out_dir = REPO / "benchmarks" / "results" / f"served-{short[args.model.name]}" / host_tag()
    if args.model.name != "smollm2":  # peerbench recorded SmolLM2 only
        args.recorded = "none"
    overrides: dict[str, str] = {}
    for item in args.engine_levels:
        name, sep, lv = item.partition("=")
        if not sep:
            ap.error(f"--engine-levels {item!r}: use ENGINE=LEVELS")
        overrides[name.strip()] = lv.strip()
    try:
        for lv in (args.levels, *overrides.values()):
            parse_levels(lv)
    except ValueError as exc:
        ap.error(str(exc))
    args.engine_levels = overrides

    shared = args.shared_peers or find_shared_peers()
    engines = {e.name: e for e in PEER_ENGINES}
    engines["llmserve"] = Engine("llmserve", args.llmserve_port, ask_model=True)
    for i, item in enumerate(args.llmserve_variant, start=1):
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            ap.error(f"--llmserve-variant {item!r}: use NAME=FLAGS")
        # a port of its own: the previous server may still be releasing its port when this one starts
        engines[name.strip()] = Engine(name.strip(), args.llmserve_port + i, ask_model=True,
                                       serve_flags=flags.strip())
    wanted = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in [*wanted, *overrides] if n not in engines]
    if unknown:
        ap.error(f"unknown engines {unknown}; known: {', '.join(engines)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    skipped: dict[str, str] = {}
    failed: list[str] = []  # available but could not be measured
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for name in wanted:
        engine = engines[name]
        reason = why_unavailable(engine, args, shared)
        if reason is None and args.dry_run:
            print(f"[peers] {name}: would run: {start_command(engine, args, shared)} "
                  f"(levels {levels_for(name, args)})")
            continue
        if reason is None and args.report_only:
            earlier = args.out_dir / f"{name}.json"
            if earlier.is_file():
                print(f"[peers] {name}: using the earlier result {earlier} (--report-only)", flush=True)
                rows.append((name, "measured", load_result(earlier)))
            else:
                reason = f"--report-only and no earlier result {earlier}"
        elif reason is None:
            res = measure(engine, args, shared)
            reason = None if res["ok"] else res["reason"]
            if res["ok"]:
                rows.append((name, "measured", load_result(res["out"])))
            else:
                failed.append(name)
        if reason is not None:
            skipped[name] = reason
            print(f"[peers] {name}: skipped: {reason}", flush=True)
        recorded = shared / "results" / f"{name}.json" if shared else None
        show = args.recorded == "all" or (args.recorded == "absent" and reason is not None)
        if show and recorded is not None and recorded.is_file():
            doc = load_result(recorded)
            when = time.strftime("%Y-%m-%d", time.localtime(doc.get("started_unix", 0)))
            rows.append((name, f"recorded {when}", doc))
    if args.dry_run:
        return 0
    md = markdown_report(rows, skipped, args.levels, args.engine_levels, args.model.title)
    md_path = args.out_dir / "peers_comparison.md"
    md_path.write_text(md)
    print(md)
    print(f"[peers] wrote {md_path}")
    if rows:
        png = args.out_dir / "peers_comparison.png"
        plot_comparison(rows, png, args.model.title)
        print(f"[peers] wrote {png}")
    if failed:
        print(f"[peers] failed to measure: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
