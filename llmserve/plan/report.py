"""A plan document out: markdown tables for stdout, JSON, and the cost-vs-traffic plot.

Like `llmserve bench`'s report, everything reads the JSON document, so a saved plan prints and plots the
same as a fresh one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmserve.bench.report import render_table
from llmserve.plan.cost import HOURS_PER_MONTH
from llmserve.plan.traffic import SECONDS_PER_DAY


def _n(value: Any, fmt: str = "{:,.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


def _length(d: dict[str, Any]) -> str:
    if d["kind"] == "uniform" and d["spread"]:
        return f"{d['mean']:g} ±{d['spread'] * 100:g} % (uniform)"
    return f"{d['mean']:g} ({d['kind']})"


def format_plan(doc: dict[str, Any]) -> str:
    """The plan as markdown: inputs in a few lines, then memory, capacity and cost tables."""
    inp, mem = doc["inputs"], doc["memory"]
    model, hw, tr, slo = inp["model"], inp["hardware"], inp["traffic"], inp["slo"]
    lines = [f"## llmserve plan: {model['name']} ({inp['quantization']}, KV {inp['kv_dtype']}) on {hw['name']}", ""]
    lines.append(f"- traffic: {_n(tr['rate'], '{:,.3g}')} req/s ({_n(tr['requests_per_day'], '{:,.0f}')}/day), "
                 f"prompt {_length(tr['prompt'])}, output {_length(tr['output'])} tokens, "
                 f"{tr['cache_hit_share'] * 100:g} % cache hits -> {_n(tr['miss_rate'], '{:,.3g}')} req/s "
                 "reach the replicas")
    lines.append(f"- SLO: p99 TTFT <= {slo['ttft_p99_s'] * 1e3:g} ms, p99 TPOT <= {slo['tpot_p99_s'] * 1e3:g} ms; "
                 f"scheduler: max_num_seqs {inp['scheduler']['max_num_seqs']}, "
                 f"{inp['scheduler']['max_num_batched_tokens']} tokens per step")
    front, wake = inp.get("front_end_s") or 0.0, inp.get("wake_s") or 0.0
    lines.append(f"- step model: {_step_model_line(inp['step_model'])}"
                 + (f"; the server's front end adds {front * 1e3:.0f} ms before the engine" if front else "")
                 + (f"; a step after {inp.get('wake_after_idle_s', 0) * 1e3:.0f} ms or more of idle takes "
                    f"{wake * 1e3:.0f} ms longer" if wake else ""))
    lines.append(f"- machine: {hw['memory_gb']:.3g} GB, ${hw['dollars_per_hour']:g}/hour")
    lines += ["", render_table(
        ["params", "weights GB", "KV bytes/token", "KV GB/seq", "tokens/seq", "max seqs (KV)", "needed", "fits"],
        [[_n(model["num_params"] / 1e9, "{:.3g}B"), _n(mem["weights_gb"], "{:.3g}"),
          _n(mem["kv_bytes_per_token"], "{:,.0f}"), _n(mem["kv_gb_per_seq"], "{:.3g}"), str(mem["tokens_per_seq"]),
          str(mem["max_concurrency_kv"]), str(mem.get("needed_concurrency", "-")),
          "yes" if mem.get("fits", mem["weights_fit"]) else "NO"]], markdown=True, left=0)]
    if not doc.get("feasible"):
        return "\n".join([*lines, "", f"**Not feasible:** {doc.get('reason')}"])
    cap, per, cost = doc["capacity"], doc["per_replica"], doc["cost"]
    pred = per["predicted"] or {}
    lines += ["", render_table(
        ["capacity req/s/replica", "replicas", "req/s per replica", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
         "TPOT p99 ms", "mean batch", "$/month", "$/1M tokens"],
        [[_n(cap["requests_per_s"], "{:.3g}"), str(doc["replicas"]), _n(per["requests_per_s"], "{:.3g}"),
          _n(pred.get("ttft_p50_ms"), "{:.0f}"), _n(pred.get("ttft_p99_ms"), "{:.0f}"),
          _n(pred.get("tpot_p50_ms"), "{:.1f}"), _n(pred.get("tpot_p99_ms"), "{:.1f}"),
          _n(pred.get("mean_batch"), "{:.1f}"), _n(cost["dollars_per_month"], "{:,.0f}"),
          _n(cost["dollars_per_1m_tokens"], "{:.3g}")]], markdown=True, left=0)]
    at_cap = _n(cost["dollars_per_1m_tokens_at_capacity"], "{:.3g}")
    lines.append(f"\nAt full capacity a replica's tokens cost ${at_cap} per 1M (prompt + output).")
    if doc["apis"]:
        rows = [[a["api"], f"{a['input_per_m']:g} / {a['output_per_m']:g}",
                 _n(a["api_dollars_per_month"], "{:,.0f}"), _n(a["self_hosted_dollars_per_month"], "{:,.0f}"),
                 "self-hosted" if a["self_hosted_cheaper"] else "API",
                 _n(a["break_even_requests_per_s"], "{:.3g}"), _n(a["break_even_requests_per_day"], "{:,.0f}"),
                 _n(a["always_cheaper_above_requests_per_s"], "{:.3g}")] for a in doc["apis"]]
        lines += ["", render_table(["API", "$/1M in / out", "API $/month", "self-hosted $/month", "cheaper",
                                    "break-even req/s", "break-even req/day", "self-hosted always cheaper above req/s"],
                                   rows, markdown=True), "",
                  "Break-even: the traffic (all requests, cache hits included) from which self-hosting costs less; "
                  "'-' = never at any traffic (a replica's capacity is worth less at the API's price than it costs)."]
    return "\n".join(lines)


def _step_model_line(sm: dict[str, Any]) -> str:
    if sm.get("kind", "").startswith("linear"):
        text = (f"fitted to bench results: {sm['overhead_s'] * 1e3:.2f} ms + {sm['per_decode_row_s'] * 1e3:.3f} ms "
                f"per decode row + {sm['per_prefill_token_s'] * 1e3:.3f} ms per prompt token")
        if sm.get("per_attention_pair_s"):
            text += f" + {sm['per_attention_pair_s'] * 1e9:.3f} ns per attention pair"
        errs = [abs(o["error"]) for o in sm.get("observations", [])]
        return text + (f" (fit error <= {max(errs) * 100:.0f} %)" if errs else "")
    return (f"roofline: {sm['bandwidth_gbs']:g} GB/s x {sm['bandwidth_efficiency']:g}, {sm['tflops']:g} TFLOP/s x "
            f"{sm['compute_efficiency']:g}, {sm['step_overhead_ms']:g} ms per step")


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def plot_plan(doc: dict[str, Any], path: str | Path) -> None:
    """Cost per month vs traffic (log-log): the fleet's step function against each API's line, break-even
    points marked, the planned traffic as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not doc.get("feasible"):
        raise ValueError(f"nothing to plot: {doc.get('reason')}")
    tr = doc["inputs"]["traffic"]
    hit = 1.0 - tr["cache_hit_share"]
    cap_total = doc["capacity"]["requests_per_s"] / hit  # total traffic one replica covers
    per_replica = doc["inputs"]["hardware"]["dollars_per_hour"] * HOURS_PER_MONTH
    marks = [r for a in doc["apis"] for r in (a["break_even_requests_per_s"],) if r]
    xs_of_interest = [x for x in (tr["rate"], cap_total, *marks) if x and x > 0]
    lo, hi = min(xs_of_interest) / 5, max(xs_of_interest) * 5
    x = np.geomspace(lo, hi, 2000)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    fleet = np.maximum(1, np.ceil(x / cap_total - 1e-9)) * per_replica
    ax.step(x, fleet, where="post", color="k", lw=2, label=f"self-hosted ({doc['inputs']['hardware']['name']})")
    for i, a in enumerate(doc["apis"]):
        color = f"C{i}"
        ax.plot(x, x * a["dollars_per_month_per_request_per_s"], color=color, lw=1.3, label=a["api"])
        if a["break_even_requests_per_s"]:
            be = a["break_even_requests_per_s"]
            ax.plot([be], [be * a["dollars_per_month_per_request_per_s"]], "o", color=color, ms=7)
            ax.annotate(f"{be * SECONDS_PER_DAY:,.0f}/day", (be, be * a["dollars_per_month_per_request_per_s"]),
                        textcoords="offset points", xytext=(4, -14 - 9 * (i % 3)), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(tr["rate"], color="grey", ls="--", lw=1)
    ax.annotate("planned traffic", (tr["rate"], 0.02), xycoords=("data", "axes fraction"), rotation=90,
                fontsize=8, color="grey", xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel("traffic (requests/s, cache hits included)")
    ax.set_ylabel("$ per month")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    model = doc["inputs"]["model"]["name"]
    ax.set_title(f"{model}: {tr['prompt']['mean']:g} in / {tr['output']['mean']:g} out tokens per request; "
                 f"one replica serves {doc['capacity']['requests_per_s']:.3g} req/s within the SLO", fontsize=9)
    secax = ax.secondary_xaxis("top", functions=(lambda r: r * SECONDS_PER_DAY, lambda d: d / SECONDS_PER_DAY))
    secax.set_xlabel("requests/day", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
