"""Benchmark: what an LLM2Vec-scale decoder costs on this CPU, eager and compiled, beside padded transformers.

Random-init Qwen2-shaped models (``SHAPES``: Qwen2-0.5B's and Qwen2-1.5B's layer shapes; the vocabulary is SmolLM2's
49,152 tokens, whose tokenizer ships with the project, instead of Qwen2's 151,936: the embedding table is a gather,
no FLOPs) are written once as bfloat16 checkpoints under ``$LAB_CACHE/scaling`` and embedded with mean pooling,
bidirectional off (causal, as the checkpoint), in ``--dtype`` (bfloat16 by default) on ``--texts`` texts of the mixed
corpus (``evals.data_io.load_corpus``; short sentences and long abstracts, cut at ``--max-length`` tokens). Systems:
the Engine eager (``compile=False``) and compiled (``compile=True``, its graphs built in the untimed warm-up and their
first calls reported as ``compile_seconds``) and transformers' ``AutoModel`` over length-sorted padded batches
(``evals.padded_transformers.PaddedTransformersEmbedder``, batch 16: the way llm2vec embeds with a decoder). Every
system embeds once untimed, then ``--repeats`` rounds time each once, interleaved; ``peak_rss_delta_mb`` is how far the
process's resident memory rose above its level before the untimed call (``VmHWM`` reset through
``/proc/self/clear_refs``: activations, workspaces and copies made on the first call, the CPU workers' threads
included; the weights loaded before it excluded), ``weights_mb`` the weights each holds.

    python -m evals.bench_scaling                                  # 0.5B and 1.5B, 64 texts, 3 rounds
    python -m evals.bench_scaling --sizes 0.5B --texts 16 --repeats 1

Writes ``evals/results/bench_scaling/bench_scaling_<machine>.csv`` (tidy rows with the CPU model, flags and ISA), its
``.meta.json`` and a plot of tokens/s per system and size beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from evals.criteria import min_cosine
from evals.data_io import load_corpus
from evals.results_index import save_run, stamp
from lab import env

RESULTS = Path(__file__).resolve().parent / "results" / "bench_scaling"
SHAPES = {  # Qwen2-0.5B / Qwen2-1.5B layer shapes (config.json of the published models)
    "0.5B": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "1.5B": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
}
BATCH = 16  # texts per padded batch (transformers)


def checkpoint(size: str) -> Path:
    """A random-init bfloat16 Qwen2 folder of ``SHAPES[size]`` with SmolLM2's tokenizer, written once."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    from lab.models.gguf import smollm2_path

    out = env.cache_root() / "scaling" / f"qwen2-{size}-random"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    config = Qwen2Config(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rope_theta=1e6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        **SHAPES[size],
    )
    torch.manual_seed(0)
    model = Qwen2Model(config).to(torch.bfloat16).eval()
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    partial.rename(out)  # complete or absent
    return out


def systems(path: Path, dtype: str, max_length: int) -> dict:
    from evals.padded_transformers import PaddedTransformersEmbedder
    from lab import Engine

    eager = Engine(str(path), dtype=dtype, pooling="mean", max_length=max_length, compile=False)
    compiled = Engine(str(path), dtype=dtype, pooling="mean", max_length=max_length, compile=True)
    padded = PaddedTransformersEmbedder(
        str(path), batch_size=BATCH, dtype=dtype, pooling="mean", max_length=max_length
    )
    return {
        "engine": (eager, eager.embed),
        "engine-compiled": (compiled, compiled.embed),
        "transformers-padded": (padded.model, padded),
    }


def run(sizes: list[str], dtype: str, n_texts: int, repeats: int, max_length: int) -> pd.DataFrame:
    from lab.eval.bench import interleaved
    from lab.ops.probes import cpu_info
    from lab.runtime import memory

    texts = load_corpus("mixed")[:n_texts]
    rows = []
    for size in sizes:
        path = checkpoint(size)
        runs = systems(path, dtype, max_length)
        first = {}
        for name, (_, fn) in runs.items():  # warm-up (the compiled engine builds its graphs here)
            before = memory.status_bytes("VmRSS") if memory.reset_peak() else None
            first[name] = fn(texts)
            first[name + ":peak"] = None if before is None else memory.status_bytes("VmHWM") - before
        tokens = sum(r.length for r in runs["engine"][0].tokenize(texts))
        timed = interleaved({name: (lambda f=fn: f(texts)) for name, (_, fn) in runs.items()}, repeats, warmup=0)
        secs = {name: wall for name, (wall, _, _) in timed.items()}
        for name, (obj, _) in runs.items():
            model = obj.model if hasattr(obj, "runner") else obj
            med = statistics.median(secs[name])
            rows.append(
                {
                    "size": size,
                    "system": name,
                    "dtype": dtype,
                    "texts": len(texts),
                    "tokens": tokens,
                    "repeats": repeats,
                    "seconds_median": med,
                    "seconds_min": min(secs[name]),
                    "seconds_max": max(secs[name]),
                    "tokens_per_s": tokens / med,
                    "min_cosine_vs_engine": min_cosine(first[name], first["engine"]),
                    "peak_rss_delta_mb": None if first[name + ":peak"] is None else first[name + ":peak"] / 2**20,
                    "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                    "compile_seconds": (
                        sum(obj.runner.compiled.compile_seconds.values()) if name == "engine-compiled" else None
                    ),
                    "cpu_paths": json.dumps(obj.cpu_paths) if hasattr(obj, "runner") else None,
                    **cpu_info(),
                }
            )
            print(
                f"{size} {name:22s} {rows[-1]['tokens_per_s']:8.1f} tok/s  peak {rows[-1]['peak_rss_delta_mb']} MB"
                f"  min cos vs engine {rows[-1]['min_cosine_vs_engine']:.5f}",
                flush=True,
            )
        del runs
    df = pd.DataFrame(rows)
    eng = df[df.system == "engine"].set_index("size").tokens_per_s
    df["ratio_vs_engine"] = [r.tokens_per_s / eng[r.size] for r in df.itertuples()]
    return df


def plot(df: pd.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(df.system))
    sizes = list(dict.fromkeys(df["size"]))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        sel = df[df.system == name].set_index("size").reindex(sizes)
        ax.bar(
            [i + (j - (len(names) - 1) / 2) * width for i in range(len(sizes))], sel.tokens_per_s, width, label=name
        )
    ax.set_xticks(range(len(sizes)), [f"Qwen2-{s} shapes" for s in sizes])
    ax.set_ylabel("tokens / s (median)")
    r = df.iloc[0]
    ax.set_title(f"{r['dtype']}, {r.texts} mixed texts, on {r.cpu_model} ({r.isa}, {r.threads} threads)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    df = stamp(run(args.sizes, args.dtype, args.texts, args.repeats, args.max_length))
    save_run(df, Path(args.out), "bench_scaling", plot(df))
    print(
        df[
            [
                "size",
                "system",
                "tokens_per_s",
                "ratio_vs_engine",
                "peak_rss_delta_mb",
                "weights_mb",
                "compile_seconds",
                "min_cosine_vs_engine",
            ]
        ].to_string(index=False, float_format=lambda v: f"{v:,.3f}")
    )


if __name__ == "__main__":
    main()
