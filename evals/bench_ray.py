"""Benchmark: RayEngine against one Engine on the same texts and cores, Ray's overhead per shard, and a projection
for N actors (GPUs).

Texts: STSBenchmark sentences (train + validation + test, both columns: 17,256), cycled to ``--texts`` (default
20,000, the issue's target: past the first 17,256 the corpus repeats from its start, and the engines embed the
repeats again like any other text). Systems, on one machine with C cores:

- ``engine``: one Engine in this process on C threads (``cpu_workers`` default: one worker per thread);
- ``ray-1xC``: RayEngine, 1 actor x C threads;
- ``ray-Cx1``: RayEngine, C actors x 1 thread (the issue's target: >= 0.9x ``engine``).

They run interleaved (engine, ray-1xC, ray-Cx1, engine, ...) after one warm-up call each; the table keeps the
median of ``--rounds``. The local Ray cluster gets 2C logical CPUs so both RayEngines stay loaded; one system runs at
a time. ``min_cosine``: the lowest per-text cosine against ``engine``'s rows.

Overhead: ``embed_dataset`` into a temporary folder with ``--shard-texts`` texts per shard, on ray-1xC (one actor:
``(wall - busy) / shards`` is what a pipelined actor loses per shard: Ray calls, transfers, the driver) and on ray-Cx1
(``(wall x actors - busy) / shards``, the tail of the last shards included); the driver's own seconds per shard
(Parquet write + manifest) timed alone; and one-text round trips, RayEngine against a local Engine call.

Projection for N actors, each at per-actor rate R (the rate ray-Cx1's actors reached while busy, or ``--rates`` for a
GPU's), shards of S tokens (``--shard-texts`` x the corpus' mean tokens per text), overhead o per shard and driver
seconds d per shard: ``tokens/s(N) = min(N S / (S / R + o), S / d)``, which assumes the actors scale perfectly and
the driver is the only shared part; ``efficiency`` is that over N R.

    python -m evals.bench_ray              # the full run (~10 min on 2 cores)
    python -m evals.bench_ray --quick      # 1,000 texts, 1 round: checks the script, writes bench_ray_quick*

Writes into ``evals/results/bench_ray/`` ``bench_ray_<machine>.csv`` (throughput),
``bench_ray_overhead_<machine>.csv``, ``bench_ray_projection_<machine>.csv`` and ``bench_ray_<machine>.png``, each row
with the run's ``run_date``, the CPU model, its flags, torch and Ray versions, each CSV's command in
``<csv>.meta.json``; the machine is ``lab.ops.probes.machine_slug()`` (``evals.results_index``). Every engine, the
actors' included, runs with ``lab.runtime.allocator``'s tuning (``LAB_MALLOC_TUNING=1``); the throughput rows'
``malloc_tuning`` says whether it was in effect.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from evals.criteria import min_cosine
from evals.data_io import read_jsonl
from evals.results_index import save_run, stamp
from lab.models.hub import local_folder

ROOT = Path(__file__).resolve().parent
DATA, RESULTS = ROOT / "data", ROOT / "results"
STS = DATA / "stsbenchmark"


def load_texts(n: int) -> tuple[list[str], str]:
    """``n`` STSBenchmark sentences, cycling the corpus when ``n`` is larger; and a note saying how."""
    corpus = [
        r[c]
        for split in ("train", "validation", "test")
        for r in read_jsonl(STS / f"{split}.jsonl.gz")
        for c in ("sentence1", "sentence2")
    ]
    note = f"STSBenchmark train+validation+test sentences ({len(corpus)})"
    if n > len(corpus):
        note += f", cycled to {n} (the corpus repeated from its start)"
    return list(itertools.islice(itertools.cycle(corpus), n)), note


def throughput(systems: dict, texts: list[str], rounds: int) -> pd.DataFrame:
    """Each system embeds ``texts`` once to warm up, then ``rounds`` times, interleaved; one row per system."""
    outputs = {name: fn(texts) for name, (fn, _) in systems.items()}
    times = {name: [] for name in systems}
    for r in range(rounds):
        for name, (fn, _) in systems.items():
            t0 = time.perf_counter()
            fn(texts)
            times[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{rounds}  {name:10s} {times[name][-1]:7.2f} s", flush=True)
    rows = []
    for name, (_, meta) in systems.items():
        secs = times[name]
        rows.append(
            {
                "system": name,
                **meta,
                "texts": len(texts),
                "rounds": rounds,
                "seconds_median": statistics.median(secs),
                "seconds_min": min(secs),
                "seconds_max": max(secs),
                "min_cosine": min_cosine(outputs[name], outputs["engine"]),
            }
        )
    df = pd.DataFrame(rows)
    df["tokens_per_s"] = df.tokens / df.seconds_median
    df["ratio_vs_engine"] = df.tokens_per_s / df.tokens_per_s[df.system == "engine"].iloc[0]
    return df


def overhead(reng_one, reng_many, texts: list[str], shard_texts: int, local) -> tuple[pd.DataFrame, dict]:
    """Per-shard overhead of ``embed_dataset`` on one actor and on several, the driver's own seconds per shard, and
    one-text round trips; plus what the projection needs (rate, overhead, driver seconds, tokens per shard)."""
    from lab.distributed import embed_dataset
    from lab.distributed.shards import Manifest, job_record, read_source, write_shard

    rows = []
    for reng in (reng_one, reng_many):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            summary = embed_dataset(reng, texts, out, shard_texts=shard_texts, show_progress=False)
            wall = time.perf_counter() - t0
        actors = len(reng.actors)
        busy = summary.seconds.sum()
        rows.append(
            {
                "measure": "embed_dataset",
                "actors": actors,
                "threads_per_actor": reng.threads_per_actor,
                "shards": len(summary),
                "shard_texts": shard_texts,
                "tokens": int(summary.tokens.sum()),
                "wall_s": wall,
                "busy_s": busy,
                "seconds_per_shard": (wall * actors - busy) / len(summary),
                "actor_tokens_per_s": summary.tokens.sum() / busy,
            }
        )
    emb = local.embed(texts[:shard_texts])
    with tempfile.TemporaryDirectory() as out:  # the driver's part of a shard, alone: Parquet write + manifest
        src = read_source(texts[:shard_texts])
        man = Manifest.open(Path(out), job_record(src, shard_texts=shard_texts, model="m", digest="m", knobs={}))
        driver = []
        for k in range(10):
            t0 = time.perf_counter()
            name = write_shard(Path(out), k, src.ids, emb)
            man.record(k, {"file": name, "rows": len(src)})
            driver.append(time.perf_counter() - t0)
    rows.append(
        {
            "measure": "driver write + manifest",
            "shards": 10,
            "shard_texts": shard_texts,
            "seconds_per_shard": statistics.median(driver),
        }
    )
    for name, fn in (
        ("round trip, one text (ray)", lambda: list(reng_one.map_chunks([(0, ["a"], 0)]))),
        ("one text, local Engine", lambda: local.embed(["a"])),
    ):
        fn()
        trips = []
        for _ in range(30):
            t0 = time.perf_counter()
            fn()
            trips.append(time.perf_counter() - t0)
        rows.append({"measure": name, "shards": 30, "seconds_per_shard": statistics.median(trips)})
    df = pd.DataFrame(rows)
    one, many = df.iloc[0], df.iloc[1]
    params = {
        "rate": many.actor_tokens_per_s,
        "overhead": max(one.seconds_per_shard, 0.0),
        "driver": df.seconds_per_shard[df.measure == "driver write + manifest"].iloc[0],
        "shard_tokens": many.tokens / many.shards,
    }
    return df, params


def projection(params: dict, rates: list[float], counts: list[int]) -> pd.DataFrame:
    """tokens/s of N actors at rate R each: N S / (S / R + o), capped at the driver's S / d."""
    s, o, d = params["shard_tokens"], params["overhead"], params["driver"]
    sources = [("cpu actor (measured)", params["rate"])] + [(f"--rates {r:g}", r) for r in rates]
    rows = []
    for source, rate in sources:
        for n in counts:
            tps = min(n * s / (s / rate + o), s / d if d > 0 else float("inf"))
            rows.append(
                {
                    "rate_source": source,
                    "actor_tokens_per_s": rate,
                    "actors": n,
                    "shard_tokens": s,
                    "overhead_s_per_shard": o,
                    "driver_s_per_shard": d,
                    "tokens_per_s": tps,
                    "efficiency": tps / (n * rate),
                    "hours_per_100M_tokens": 1e8 / tps / 3600,
                    "driver_bound": n * s / (s / rate + o) > s / d if d > 0 else False,
                }
            )
    return pd.DataFrame(rows)


def plot(tp: pd.DataFrame, proj: pd.DataFrame, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(tp))
    ax.bar(x, tp.tokens_per_s, color=["#999999"] + ["#1f77b4"] * (len(tp) - 1))
    ax.errorbar(
        x,
        tp.tokens_per_s,
        yerr=[tp.tokens_per_s - tp.tokens / tp.seconds_max, tp.tokens / tp.seconds_min - tp.tokens_per_s],
        fmt="none",
        color="k",
        capsize=3,
    )
    for i, r in enumerate(tp.itertuples()):
        ax.text(i, r.tokens / r.seconds_min, f"{r.ratio_vs_engine:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.axhline(0.9 * tp.tokens_per_s.iloc[0], color="r", ls="dotted", label="0.9x engine (target)")
    ax.set_xticks(x, tp.system)
    ax.set_ylabel("tokens / s (median)")
    ax.legend(fontsize=8, loc="lower right")
    for source, g in proj.groupby("rate_source", sort=False):
        line = ax2.plot(g.actors, g.tokens_per_s, marker="o", label=source)[0]
        ax2.plot(g.actors, g.actors * g.actor_tokens_per_s, ls="dotted", color=line.get_color())
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("actors (one per GPU)")
    ax2.set_ylabel("projected tokens / s (dotted: N x rate)")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (org/name[@revision]; default: bundled all-MiniLM-L6-v2)"
    )
    parser.add_argument("--texts", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shard-texts", type=int, default=2048)
    parser.add_argument("--rates", type=float, nargs="*", default=[], help="per-actor tokens/s to project (a GPU's)")
    parser.add_argument("--quick", action="store_true", help="1,000 texts, 1 round, 250-text shards; *_quick files")
    parser.add_argument("--out", default=str(RESULTS / "bench_ray"), help="folder (default evals/results/bench_ray)")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.rounds, args.shard_texts = 1000, 1, 250
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lab.runtime.allocator's tuning in every engine, the actors' included (Ray's local workers inherit this
    # environment); each system's rows say whether it was in effect (malloc_tuning)
    os.environ["LAB_MALLOC_TUNING"] = "1"
    if args.model is None:
        from lab._extras import minilm_path

        args.model = minilm_path()
    args.model = local_folder(args.model)
    import ray
    import torch

    from lab import Engine
    from lab.distributed import RayEngine
    from lab.ops.probes import cpu_info

    cores = os.cpu_count() or 1
    texts, note = load_texts(args.texts)
    ray.init(address="local", num_cpus=2 * cores, include_dashboard=False)  # both RayEngines loaded at once
    try:
        torch.set_num_threads(cores)
        eng = Engine(args.model)
        one = RayEngine(args.model, num_actors=1, threads_per_actor=cores)
        many = RayEngine(args.model, num_actors=cores, threads_per_actor=1)
        tokens = sum(r.length for r in eng.tokenize(texts))
        systems = {
            "engine": (
                eng.embed,
                {
                    "actors": 0,
                    "threads_per_actor": cores,
                    "tokens": tokens,
                    "malloc_tuning": eng.resolved["malloc_tuning"],
                },
            ),
            f"ray-1x{cores}": (
                one.embed,
                {
                    "actors": 1,
                    "threads_per_actor": cores,
                    "tokens": tokens,
                    "malloc_tuning": one.resolved["malloc_tuning"],
                },
            ),
            f"ray-{cores}x1": (
                many.embed,
                {
                    "actors": cores,
                    "threads_per_actor": 1,
                    "tokens": tokens,
                    "malloc_tuning": many.resolved["malloc_tuning"],
                },
            ),
        }
        tp = throughput(systems, texts, args.rounds)
        ov, params = overhead(one, many, texts, args.shard_texts, eng)
        one.close()
        many.close()
    finally:
        ray.shutdown()
    proj = projection(params, args.rates, [1, 2, 4, 8, 16, 32, 64])
    machine = {**cpu_info(), "cores": cores, "ray": ray.__version__, "model": eng.model_name, "corpus": note}
    tp, ov, proj = (stamp(df.assign(**machine)) for df in (tp, ov, proj))
    out, suffix = Path(args.out), "_quick" if args.quick else ""
    title = (
        f"{machine['model']} on {machine['cpu_model']} ({cores} cores), {len(texts):,} texts, median of "
        f"{args.rounds}; Ray {ray.__version__}"
    )
    save_run(tp, out, f"bench_ray{suffix}", plot(tp, proj, title))
    save_run(ov, out, f"bench_ray_overhead{suffix}")
    save_run(proj, out, f"bench_ray_projection{suffix}")
    fmt = {"float_format": lambda v: f"{v:,.4g}", "index": False}
    print(note)
    print(tp[["system", "tokens", "seconds_median", "tokens_per_s", "ratio_vs_engine", "min_cosine"]].to_string(**fmt))
    print(ov[["measure", "actors", "shards", "seconds_per_shard", "actor_tokens_per_s"]].to_string(**fmt))
    print(proj[["rate_source", "actors", "tokens_per_s", "efficiency", "driver_bound"]].to_string(**fmt))


if __name__ == "__main__":
    main()
