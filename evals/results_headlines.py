"""The one-line summaries of runs in ``evals/results/README.md`` (``evals/results_index.py``): ``headline``, by the
rule of the run's benchmark (``HEADLINES``), and ``fastest_peer``, the fastest other system of a bench_peers CSV
beside the Engine's speed (for that benchmark's headline and README.md's speed block)."""

from __future__ import annotations

# the rows of a bench_peers CSV that are prefill-lab itself, not a peer
ENGINE_SYSTEMS = {"engine", "lab", "prefill-lab"}


def as_number(text) -> float | None:
    """A CSV cell as a float; None where it is empty or not a number."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _headline_bench_embed(rows):
    corpora = sorted({r["corpus"] for r in rows})
    corpus = "mixed" if "mixed" in corpora else corpora[0]
    parts = []
    for r in rows:
        if r["system"] == "engine" and r["corpus"] == corpus:
            parts.append(
                f"{r['dtype']} {as_number(r['tokens_per_s']):,.0f} tok/s "
                f"({as_number(r['ratio_vs_sentence_transformers']):.2f}x sentence-transformers)"
            )
    return f"{corpus}: " + "; ".join(parts)


def _headline_bench_decoder(rows):
    parts = []
    for r in rows:
        if r.get("metric") == "speedup_vs_best_baseline":
            parts.append(f"{r['dtype']} {r['pooling']} {as_number(r['value']):.2f}x")
    if parts:
        return "Engine vs padded transformers: " + ", ".join(parts)
    peaks = [(r["setting"], as_number(r["value"])) for r in rows if r.get("metric") == "peak_tensor_mb"]
    if peaks:
        return "peak tensor MB: " + "; ".join(f"{s} {v:.1f}" for s, v in peaks[:3])
    return None


def _headline_bench_attention(rows):
    lab = [r for r in rows if r["kernel"] == "lab"]
    best = {}
    for r in lab:
        key = (r["model"], r["dtype"])
        best.setdefault(key, []).append(as_number(r["time_vs_sdpa"]))
    return "lab kernel time vs sdpa: " + ", ".join(f"{m} {d} {min(v):.2f}-{max(v):.2f}" for (m, d), v in best.items())


def _headline_bench_outputs(rows):
    ratios = {}
    for r in rows:
        ratios.setdefault(r["output"], []).append(as_number(r["ratio_vs_dense"]))
    return "tokens / dense: " + ", ".join(f"{o} {min(v):.2f}" for o, v in ratios.items() if o != "dense")


def _headline_bench_ray(rows):
    if rows and "ratio_vs_engine" in rows[0]:
        return ", ".join(f"{r['system']} {as_number(r['ratio_vs_engine']):.2f}x one Engine" for r in rows)
    if rows and "seconds_per_shard" in rows[0] and "measure" in rows[0]:
        return ", ".join(
            f"{r['measure']} {as_number(r['seconds_per_shard']):.3f} s per shard"
            for r in rows
            if as_number(r["seconds_per_shard"]) is not None
        )
    if rows and "hours_per_100M_tokens" in rows[0]:
        return ", ".join(
            f"{r['actors']} actors {as_number(r['hours_per_100M_tokens']):.1f} h / 100M tokens" for r in rows[:4]
        )
    return None


def _headline_causal(rows):
    return "Spearman x100: " + ", ".join(
        f"{r['pooling']} {r['attention']} {as_number(r['spearman_x100']):.1f}" for r in rows
    )


def _headline_rerank(rows):
    return "MAP: " + ", ".join(
        f"{r['model']} ({r['mode']}) {as_number(r['value']):.3f}" for r in rows if r["metric"] == "map"
    )


def _headline_gpu_check(rows):
    checks = [r["ok"] for r in rows if r.get("ok") in ("True", "False")]
    speed = [
        f"{r['provider']} {as_number(r['speedup']):.2f}x"
        for r in rows
        if r.get("section") == "engine" and r.get("metric") == "s" and r.get("provider", "").startswith("engine")
    ]
    return f"{checks.count('True')}/{len(checks)} checks pass" + (
        "; vs sentence-transformers " + ", ".join(speed) if speed else ""
    )


def _headline_mteb(rows):
    return "main score x100: " + ", ".join(
        f"{r['variant']} {r['task']} {100 * as_number(r['score']):.2f}" for r in rows if r.get("main") == "True"
    )


def _headline_throughput(rows):
    ratios = [as_number(r.get("vs_sentence_transformers")) for r in rows if r["system"] == "engine"]
    ratios = [r for r in ratios if r is not None]
    return f"Engine {min(ratios):.2f}-{max(ratios):.2f}x sentence-transformers over token budgets" if ratios else None


def _headline_bench_peers(rows):
    parts = []
    for corpus, dtype in sorted({(r.get("corpus", ""), r.get("dtype", "")) for r in rows}):
        best = fastest_peer(rows, corpus, dtype)
        if best:
            name, tps, own = best
            parts.append(
                f"{corpus} {dtype}: fastest peer {name} {tps:,.0f} tok/s"
                + (f", Engine {own / tps:.2f}x" if own else "")
            )
    return "; ".join(parts) or None


HEADLINES = {
    "bench_embed": _headline_bench_embed,
    "bench_decoder": _headline_bench_decoder,
    "bench_attention": _headline_bench_attention,
    "bench_outputs": _headline_bench_outputs,
    "bench_ray": _headline_bench_ray,
    "bench_peers": _headline_bench_peers,
    "causal_vs_bidirectional": _headline_causal,
    "rerank_twitter": _headline_rerank,
    "gpu_check": _headline_gpu_check,
    "mteb": _headline_mteb,
    "throughput": _headline_throughput,
}


def headline(benchmark: str, rows: list[dict[str, str]]) -> str:
    """The run's one-line summary (``HEADLINES[benchmark]``), or its row count where there is no rule for the
    benchmark or its rows lack the rule's columns."""
    rule = HEADLINES.get(benchmark)
    text = None
    if rule and rows:
        try:
            text = rule(rows)
        except (KeyError, TypeError, ValueError, IndexError):
            text = None
    return text or f"{len(rows)} rows"


def _is_engine(system: str) -> bool:
    """An Engine row of a peers CSV: ``engine`` or ``engine-<precision>`` (``evals/bench_peers.py``)."""
    return system in ENGINE_SYSTEMS or system.startswith("engine-")


def fastest_peer(rows, corpus: str, dtype: str):
    """(fastest peer's name, its tokens/s, the Engine's tokens/s in the same file or None) for one corpus and
    precision of a bench_peers CSV (its ``precision_class`` column, else ``dtype``; columns it lacks match
    everything). Rows flagged ``matches=False`` (vectors unlike sentence-transformers') and GPU rows are left out."""

    def same(r):
        cls = r.get("precision_class", r.get("dtype", dtype))
        return (
            r.get("corpus", corpus) == corpus
            and cls == dtype
            and r.get("device", "cpu") == "cpu"
            and str(r.get("matches", "True")) != "False"
        )

    peers = [(r["system"], as_number(r.get("tokens_per_s"))) for r in rows if same(r) and not _is_engine(r["system"])]
    peers = [(s, t) for s, t in peers if t]
    engine = [as_number(r.get("tokens_per_s")) for r in rows if same(r) and _is_engine(r["system"])]
    if not peers:
        return None
    name, tps = max(peers, key=lambda p: p[1])
    return name, tps, next((e for e in engine if e), None)
