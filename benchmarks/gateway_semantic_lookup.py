"""Which nearest-neighbour library the gateway's semantic cache uses: single-query search latency (p50/p99)
and recall@1 against exact brute force, for usearch, hnswlib and faiss (HNSW, inner product on unit vectors
= cosine), at 10k and 100k entries; exact search (numpy, faiss IndexFlatIP) as the baseline. And, apart, the
time MiniLM takes to embed one query, which a lookup pays on top of the search.

    .venv/bin/python benchmarks/gateway_semantic_lookup.py [--sizes 10000,100000] [--data shaped|random]

Entries (`--data shaped`, the default) are drawn from a Gaussian with the mean and covariance of real MiniLM
embeddings of real sentences (gensim's Lee corpus), those real embeddings in the first rows; `--data random`:
uniform unit vectors, the hardest case for a graph index (no structure to walk). Three query sets:
- near: an entry plus isotropic noise, cosine ~0.92 to it: a paraphrase at the hit threshold, the case a
  semantic cache must not miss (the recall the choice is made on; latency is timed on these);
- fresh: new draws from the entries' distribution (unrelated questions; in a cache, misses whatever is found);
- real: held-out real sentences' embeddings (their neighbours are the real rows).
Every library gets the same graph parameters (M=16, ef_construction=64) and the same ef_search sweep.
Latency is wall time of one `search` call from Python for one query, k=1 (the cache asks for k=1).
Writes benchmarks/results/gateway_semantic_lookup.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve.evaluate.datasets import perplexity_text  # noqa: E402
from llmserve.gateway.embedder import Embedder  # noqa: E402

DIM, M, EF_CONSTRUCTION, EF_SEARCH = 384, 16, 64, (32, 64, 128, 256)
RESULTS = Path(__file__).resolve().parent / "results"
Search = Callable[[np.ndarray], int]  # one unit query -> the row it found


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 50) * 1e3), float(np.percentile(samples, 99) * 1e3)


def timed(search: Search, queries: np.ndarray) -> tuple[list[int], list[float]]:
    found, times = [], []
    for q in queries:
        start = time.perf_counter()
        found.append(search(q))
        times.append(time.perf_counter() - start)
    return found, times


def builders(data: np.ndarray) -> dict[str, tuple[Callable[[int], Search], float]]:
    """name -> (ef_search -> search function, build seconds)."""
    import faiss
    import hnswlib
    from usearch.index import Index

    keys = np.arange(len(data))
    out: dict[str, tuple[Callable[[int], Search], float]] = {}

    start = time.perf_counter()
    u = Index(ndim=DIM, metric="ip", dtype="f32", connectivity=M, expansion_add=EF_CONSTRUCTION)
    u.add(keys, data)

    def usearch_at(ef: int) -> Search:
        u.expansion_search = ef
        return lambda q: int(u.search(q, 1).keys[0])
    out["usearch"] = (usearch_at, time.perf_counter() - start)

    start = time.perf_counter()
    h = hnswlib.Index(space="ip", dim=DIM)
    h.init_index(max_elements=len(data), ef_construction=EF_CONSTRUCTION, M=M)
    h.add_items(data, keys)

    def hnswlib_at(ef: int) -> Search:
        h.set_ef(ef)
        return lambda q: int(h.knn_query(q, k=1)[0][0, 0])
    out["hnswlib"] = (hnswlib_at, time.perf_counter() - start)

    start = time.perf_counter()
    f = faiss.IndexHNSWFlat(DIM, M, faiss.METRIC_INNER_PRODUCT)
    f.hnsw.efConstruction = EF_CONSTRUCTION
    f.add(data)

    def faiss_at(ef: int) -> Search:
        f.hnsw.efSearch = ef
        return lambda q: int(f.search(q[None], 1)[1][0, 0])
    out["faiss-hnsw"] = (faiss_at, time.perf_counter() - start)

    flat = faiss.IndexFlatIP(DIM)
    flat.add(data)
    out["faiss-flat (exact)"] = (lambda ef: lambda q: int(flat.search(q[None], 1)[1][0, 0]), 0.0)
    out["numpy (exact)"] = (lambda ef: lambda q: int(np.argmax(data @ q)), 0.0)
    return out


def real_sentences(limit: int) -> list[str]:
    sentences = [s.strip() for line in perplexity_text().splitlines() for s in re.split(r"(?<=[.!?])\s+", line)]
    return [s for s in dict.fromkeys(sentences) if len(s.split()) >= 5][:limit]


def host() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    import os

    return f"{model}, {os.cpu_count()} CPUs, {simd}"


def shaped(real: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` unit vectors drawn from a Gaussian with the real embeddings' mean and covariance: MiniLM's
    anisotropy (unrelated texts at cosine ~0.08, not 0) without embedding 100k texts."""
    mu = real.mean(0)
    basis = (real - mu) / np.sqrt(len(real) - 1)
    return unit(mu + rng.standard_normal((size, len(real))) @ basis + 0.01 * rng.standard_normal((size, DIM)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000", help="entries per index (default: %(default)s)")
    ap.add_argument("--data", choices=["shaped", "random"], default="shaped",
                    help="entries: MiniLM-shaped Gaussian or uniform on the sphere (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=500, help="near queries, timed (default: %(default)s)")
    ap.add_argument("--real", type=int, default=256, help="real sentences embedded (default: %(default)s)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    wall = time.perf_counter()

    embedder = Embedder()
    sentences = real_sentences(args.real)
    start = time.perf_counter()
    real = np.concatenate([embedder.embed(sentences[i:i + 64]) for i in range(0, len(sentences), 64)])
    print(f"embedded {len(sentences)} real sentences in {time.perf_counter() - start:.1f} s", flush=True)
    held_out = len(sentences) // 8
    real_rows, real_queries = real[held_out:], real[:held_out]
    embed_times = []
    for s in sentences[:100]:
        start = time.perf_counter()
        embedder.embed([s])
        embed_times.append(time.perf_counter() - start)
    embed_ms = percentiles_ms(embed_times)
    print(f"MiniLM, one query: p50 {embed_ms[0]:.2f} ms, p99 {embed_ms[1]:.2f} ms", flush=True)

    rows = []
    for size in map(int, args.sizes.split(",")):
        draw = (lambda n: shaped(real_rows, n, rng)) if args.data == "shaped" else \
            (lambda n: unit(rng.standard_normal((n, DIM))))
        data = draw(size)
        data[:len(real_rows)] = real_rows
        picks = rng.integers(len(real_rows), size, args.queries)
        sets = {"near": unit(data[picks] + 0.42 * unit(rng.standard_normal((args.queries, DIM)))),
                "fresh": draw(200), "real": real_queries}
        truth = {name: np.argmax(qs @ data.T, axis=1) for name, qs in sets.items()}
        near_cos = float(np.mean(np.sum(sets["near"] * data[picks], axis=1)))
        for name, (make, build_s) in builders(data).items():
            for ef in EF_SEARCH if build_s else (0,):
                search = make(ef)
                for q in sets["near"][:50]:  # warm up
                    search(q)
                timed_set = sets["near"] if build_s else sets["near"][:100]  # exact: recall 1 by definition
                found, times = timed(search, timed_set)
                recall = {k: float(np.mean(np.array(timed(search, qs)[0]) == truth[k])) if build_s else 1.0
                          for k, qs in sets.items()}
                recall["near"] = float(np.mean(np.array(found) == truth["near"][:len(found)]))
                p50, p99 = percentiles_ms(times)
                rows.append({"entries": size, "library": name, "ef_search": ef or None, "build_s": round(build_s, 1),
                             "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
                             **{f"recall_{k}": round(v, 3) for k, v in recall.items()}})
                print(rows[-1], flush=True)
        del data

    target = {10000: 5.0, 100000: 10.0}
    lines = [f"Host: {host()}. Entries: {args.data}. Near queries' mean cosine to their entry: {near_cos:.3f}. "
             f"HNSW: M={M}, ef_construction={EF_CONSTRUCTION}.", "",
             f"MiniLM embedding of one query (apart from the search): p50 {embed_ms[0]:.2f} ms, "
             f"p99 {embed_ms[1]:.2f} ms.", "",
             "| entries | library | ef_search | build s | p50 ms | p99 ms | recall@1 near | recall@1 fresh "
             "| recall@1 real | p99 target |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = target.get(r["entries"])
        ok = "" if goal is None else ("met" if r["p99_ms"] <= goal and r["recall_near"] >= 0.95 else "missed")
        lines.append(f"| {r['entries']} | {r['library']} | {r['ef_search'] or '-'} | {r['build_s'] or '-'} "
                     f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['recall_near']:.3f} | {r['recall_fresh']:.3f} "
                     f"| {r['recall_real']:.3f} | {ok} |")
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_semantic_lookup.md").write_text("# Semantic cache lookup\n\n" + table + "\n")
    (RESULTS / "gateway_semantic_lookup.json").write_text(json.dumps(
        {"host": host(), "data": args.data, "embed_one_query_ms": {"p50": embed_ms[0], "p99": embed_ms[1]},
         "seconds": round(time.perf_counter() - wall), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
