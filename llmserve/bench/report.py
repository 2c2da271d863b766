"""Results out: the console table, the JSON document, the plot, and `compare` across result files.

Why everything works on the JSON document (a dict) rather than live objects: a report printed at the
end of a run, one re-printed from a saved file and a comparison of files from different days (or from
peerbench's loadgen.py, whose summary keys are a subset of ours) all go through the same code.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmserve.bench.runner import BenchmarkResult

SCHEMA = "llmserve-bench/1"

# (header, summary key, format); latencies in ms
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("ok/n", "", ""),
    ("wall s", "wall_s", "{:.1f}"),
    ("out tok/s", "output_tok_per_s", "{:.1f}"),
    ("req/s", "req_per_s", "{:.2f}"),
    ("goodput", "goodput_req_per_s", "{:.2f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("p90", "ttft_p90_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("p90", "itl_p90_ms", "{:.1f}"),
    ("p99", "itl_p99_ms", "{:.1f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("p99", "tpot_p99_ms", "{:.1f}"),
    ("E2E p50", "e2e_p50_ms", "{:.0f}"),
    ("p99", "e2e_p99_ms", "{:.0f}"),
    ("out/req", "output_tokens_per_req_mean", "{:.1f}"),
    ("in/req", "prompt_tokens_server_mean", "{:.1f}"),
)

# (name, key, higher is better)
COMPARE_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("out tok/s", "output_tok_per_s", True),
    ("req/s", "req_per_s", True),
    ("goodput req/s", "goodput_req_per_s", True),
    ("TTFT p50 ms", "ttft_p50_ms", False),
    ("TTFT p99 ms", "ttft_p99_ms", False),
    ("ITL p50 ms", "itl_p50_ms", False),
    ("ITL p99 ms", "itl_p99_ms", False),
    ("TPOT p50 ms", "tpot_p50_ms", False),
    ("TPOT p99 ms", "tpot_p99_ms", False),
    ("E2E p50 ms", "e2e_p50_ms", False),
    ("E2E p99 ms", "e2e_p99_ms", False),
    ("failed", "num_failed", False),
)


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    try:
        return fmt.format(value) if fmt else str(value)
    except (TypeError, ValueError):
        return str(value)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False,
                 left: int = 1) -> str:
    """Plain aligned text (first `left` columns left-aligned, numbers right) or a markdown table."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" if i < left else "---:" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def level_label(s: dict[str, Any]) -> str:
    if s.get("label"):
        return str(s["label"])
    if s.get("mode") == "rate":
        return f"rate={s.get('request_rate')}"
    return f"c={s.get('concurrency')}"


def level_key(s: dict[str, Any]) -> tuple[str, float]:
    """Identity of a level across files: (mode, concurrency or rate)."""
    if s.get("mode") == "rate":
        r = s.get("request_rate")
        return ("rate", math.inf if r in ("inf", None) else float(r))
    return ("concurrency", float(s.get("concurrency") or 0))


def summary_table(summaries: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One row per level; the goodput column only when an SLO was given."""
    cols = [c for c in TABLE_COLUMNS if c[1] != "goodput_req_per_s" or
            any("goodput_req_per_s" in s for s in summaries)]
    rows = []
    for s in summaries:
        cells = [level_label(s)]
        for _h, key, fmt in cols:
            ok_n = f"{s.get('num_ok', '-')}/{s.get('num_requests', '-')}"
            cells.append(_fmt(s.get(key), fmt) if key else ok_n)
        rows.append(cells)
    return render_table(["level", *(c[0] for c in cols)], rows, markdown=markdown)


def format_report(doc: dict[str, Any]) -> str:
    """The console report of one result document: header, table, errors per level, notes."""
    server = doc.get("server", {})
    wl = doc.get("workload", {})
    lines = [
        f"== {doc.get('engine', '?')} == {server.get('base_url', '')} model={server.get('model', '?')} "
        f"endpoint={server.get('endpoint', 'chat')} workload={wl.get('name', '?')}  (times in ms)",
        summary_table(doc.get("summary", [])),
    ]
    for lv in doc.get("levels", []):
        s = lv.get("summary", {})
        errs = s.get("errors_by_kind") or {}
        if errs:
            first = next((r for r in lv.get("requests", []) if not r.get("ok")), {})
            kinds = ", ".join(f"{k} x{v}" for k, v in errs.items())
            lines.append(f"{level_label(s)} errors: {kinds}; first: {first.get('error', '')!s:.160}")
    lines += [f"note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines)


def build_document(result: BenchmarkResult, *, label: str, config: dict[str, Any], workload: dict[str, Any],
                   started_unix: float, finished_unix: float) -> dict[str, Any]:
    """The `--out` JSON: config, target, workload, warm-up, per-level summaries and per-request records."""
    client = asdict(result.client)
    if client.get("api_key"):
        client["api_key"] = "***"
    warm = result.warmup
    return {
        "schema": SCHEMA,
        "engine": label,
        "timestamp": datetime.fromtimestamp(started_unix, UTC).isoformat(),
        "started_unix": started_unix,
        "finished_unix": finished_unix,
        "server": {"base_url": result.client.base_url, "url": result.client.url, "model": result.client.model,
                   "endpoint": result.client.endpoint},
        "config": config,
        "client": client,
        "workload": workload,
        "client_host": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "cpus": os.cpu_count()},
        "notes": list(result.notes),
        "warmup": {"num_requests": len(warm), "num_ok": sum(r.ok for r in warm),
                   "errors": [r.error for r in warm if r.error][:5],
                   "sample_text": warm[0].text[:400] if warm else None},
        "summary": [lv.summary for lv in result.levels],
        "levels": [{"summary": lv.summary, "requests": [r.to_json() for r in lv.records]}
                   for lv in result.levels],
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    tmp.replace(p)


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file of `llmserve bench --out` (or of peerbench's loadgen.py)."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("summary"), list):
        raise ValueError(f"{path}: not a benchmark result (no 'summary' list)")
    return doc


def file_labels(docs: Sequence[dict[str, Any]], paths: Sequence[str | Path] | None) -> list[str]:
    labels = [str(d.get("engine") or "") for d in docs]
    if paths is not None and (len(set(labels)) < len(labels) or not all(labels)):
        labels = [Path(p).stem for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{i + 1}:{lab}" for i, lab in enumerate(labels)]
    return labels


def compare_table(docs: Sequence[dict[str, Any]], paths: Sequence[str | Path] | None = None,
                  markdown: bool = False) -> str:
    """Side-by-side per level and metric, with ratios of every file to the first (b/a, c/a, ...)."""
    if len(docs) < 2:
        raise ValueError("compare needs at least two result files")
    labels = file_labels(docs, paths)
    letters = [chr(ord("a") + i) if i < 26 else str(i) for i in range(len(docs))]
    by_level = [{level_key(s): s for s in d["summary"]} for d in docs]
    keys: list[tuple[str, float]] = []
    for m in by_level:
        keys += [k for k in m if k not in keys]
    headers = ["level", "metric", *(f"{lab} ({x})" for lab, x in zip(labels, letters, strict=True)),
               *(f"{x}/a" for x in letters[1:])]
    rows = []
    for key in keys:
        first_row = True
        for name, metric, _higher in COMPARE_METRICS:
            values = [m.get(key, {}).get(metric) for m in by_level]
            if all(v is None for v in values):
                continue
            label = next((level_label(m[key]) for m in by_level if key in m), "?") if first_row else ""
            first_row = False
            fmt = "{:.0f}" if metric == "num_failed" else "{:.2f}" if metric.endswith("per_s") else "{:.1f}"
            ratios = []
            for v in values[1:]:
                base = values[0]
                ok = isinstance(v, int | float) and isinstance(base, int | float) and base
                ratios.append(f"{v / base:.2f}x" if ok else "-")
            rows.append([label, name, *(_fmt(v, fmt) for v in values), *ratios])
    legend = ("ratios are each file over the first (a); higher is better for tok/s, req/s and goodput, "
              "lower for latencies and failures")
    files = [f"{x} = {lab}" + (f" ({p})" if paths else "")
             for x, lab, p in zip(letters, labels, paths or labels, strict=True)]
    table = render_table(headers, rows, markdown=markdown, left=2)
    sep = "\n\n" if markdown else "\n"
    return sep.join([*(files if not markdown else ["; ".join(files)]), table, legend])


def _x_values(summaries: Sequence[dict[str, Any]]) -> tuple[list[float], str]:
    keys = [level_key(s) for s in summaries]
    mode = keys[0][0] if keys else "concurrency"
    xs = [k[1] for k in keys]
    finite = [x for x in xs if math.isfinite(x)]
    top = max(finite) * 2 if finite else 1.0
    return [x if math.isfinite(x) else top for x in xs], mode


def plot_results(docs: Sequence[dict[str, Any]], path: str | Path,
                 labels: Sequence[str] | None = None) -> None:
    """PNG: output tok/s, TTFT and ITL percentiles vs concurrency (or request rate).

    One file: p50/p90/p99 lines. Several files: one colour per file, p50 solid and p99 dashed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels is not None else file_labels(docs, None)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    single = len(docs) == 1
    xlabel = "concurrency"
    for i, (doc, lab) in enumerate(zip(docs, labels, strict=True)):
        summaries = [s for s in doc.get("summary", []) if s.get("num_requests")]
        if not summaries:
            continue
        xs, mode = _x_values(summaries)
        xlabel = "request rate (req/s)" if mode == "rate" else "concurrency"
        color = f"C{i}"
        axes[0].plot(xs, [s.get("output_tok_per_s") or 0 for s in summaries], "o-", color=color, label=lab)
        for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
            pcts = (50, 90, 99) if single else (50, 99)
            for j, p in enumerate(pcts):
                ys = [s.get(f"{metric}_p{p}_ms") for s in summaries]
                pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if not pts:
                    continue
                style = ("-", "--", ":")[j]
                ax.plot([a for a, _ in pts], [b for _, b in pts], "o" + style,
                        color=f"C{j}" if single else color, label=f"p{p}" if single else f"{lab} p{p}")
    titles = ("output throughput (tok/s)", "TTFT (ms)", "inter-token latency (ms)")
    ticks = sorted({x for doc in docs for x in _x_values(doc.get("summary", []))[0]})
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if xlabel == "concurrency" and ticks and min(ticks) > 0:
            ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if y is not None]
        lo, hi = (min(ys), max(ys)) if ys else (0.0, 0.0)
        if title.startswith("TTFT") and lo > 0 and hi / lo > 20:
            ax.set_yscale("log")  # queueing makes TTFT span decades
        else:
            ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    names = ", ".join(labels)
    fig.suptitle(f"llmserve bench: {names}", fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
