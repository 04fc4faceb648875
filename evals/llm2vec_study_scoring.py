"""The LLM2Vec study's scores (``evals/llm2vec_study.py``): Spearman x100 of cosine vs gold on the STS sets
(``Scorer``: each distinct sentence embedded once, each score keyed by everything it depends on so that an unchanged
one is read back), one row per variant and task (``evaluate_variants``) and the layer sweep (``layer_sweep``)."""

from __future__ import annotations

import time
from pathlib import Path

from evals.data_io import DATA, read_jsonl
from evals.llm2vec_study_recipe import ENGINE, HELD_OUT, SETS, VARIANTS, variants

ROOT = Path(__file__).resolve().parents[1]


def load_sets(tasks, limit: int | None) -> dict[str, list[dict]]:
    """Task -> its pairs (``limit`` evenly spaced ones per task, all when None)."""
    from evals.data_io import spread

    sets = {}
    for task in tasks:
        rows = [r for f in SETS[task] for r in read_jsonl(DATA / f"{f}.jsonl.gz")]
        sets[task] = [rows[i] for i in spread(len(rows), limit)]
    return sets


def _file_hash(path: Path) -> str:
    import hashlib

    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Scorer:
    """Spearman x100 of cosine vs gold (MTEB's STS main score) for one variant at one layer, on several sets at once:
    each distinct sentence is embedded once.

    Every score carries a ``key``: a hash of everything it depends on (the base model's files, the adapters' weight
    and config files, the Engine's arguments and knobs, the layer, the set's data files and ``limit``, the source of
    ``lab`` and ``kernels``, of this scoring code and of the Spearman it uses, and the torch version). A score whose
    key is in ``earlier`` (rows of an earlier results table) is taken from there instead of computed, so a variant
    the training text does not touch (the base model, causal or bidirectional) is scored once, and any change to the
    model, the code or the data scores it again.
    """

    def __init__(self, eng, base: Path, limit: int | None, earlier=None):
        import hashlib
        import inspect

        import torch

        from evals import causal_vs_bidirectional, data_io

        self.eng, self.limit = eng, limit
        self.earlier = (
            {}
            if earlier is None or "key" not in earlier
            else {k: r for k, r in zip(earlier["key"], earlier.to_dict("records"))}
        )
        h = hashlib.sha1(repr((ENGINE, torch.__version__)).encode())
        for fn in (
            Scorer.key,
            Scorer.score,
            load_sets,
            causal_vs_bidirectional.spearman,
            causal_vs_bidirectional.ranks,
            causal_vs_bidirectional.pearson,
            data_io.read_jsonl,
            data_io.spread,
        ):
            h.update(inspect.getsource(fn).encode())
        for f in sorted(p for p in base.iterdir() if p.suffix in (".safetensors", ".json", ".gguf", ".bin")):
            h.update(f"{f.name}:{_file_hash(f)}".encode())
        for f in sorted([*(ROOT / "lab").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
            h.update(f"{f.relative_to(ROOT)}:{_file_hash(f)}".encode())
        self._common = h.hexdigest()

    def key(self, knobs: dict, task: str, layer: int | None) -> str:
        import hashlib

        parts = [
            self._common,
            repr(sorted((k, v) for k, v in knobs.items() if k != "adapters")),
            repr(layer),
            repr(self.limit),
            *(_file_hash(DATA / f"{f}.jsonl.gz") for f in SETS[task]),
        ]
        for a in knobs.get("adapters", ()):
            parts += [_file_hash(Path(a) / f) for f in ("adapter_config.json", "adapter_model.safetensors")]
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]

    def score(self, knobs: dict, tasks, layer: int | None = None) -> list[dict]:
        """One row per task: ``task``, ``spearman_x100``, ``seconds``, ``texts`` and ``tokens`` (of the embedding
        call, shared by the tasks scored together), ``key``, ``reused`` (True when taken from ``earlier``)."""
        import numpy as np

        from evals.causal_vs_bidirectional import spearman

        keys = {t: self.key(knobs, t, layer) for t in tasks}
        rows = {t: {**self.earlier[k], "reused": True} for t, k in keys.items() if k in self.earlier}
        todo = [t for t in tasks if t not in rows]
        if todo:
            sets = load_sets(todo, self.limit)
            sentences = sorted({r[k] for rs in sets.values() for r in rs for k in ("sentence1", "sentence2")})
            where = {s: i for i, s in enumerate(sentences)}
            self.eng.configure(**knobs, layer=layer)
            t0 = time.perf_counter()
            e = self.eng.embed(sentences, show_progress=False)
            seconds = time.perf_counter() - t0
            tokens = self.eng.stats.tokens
            e = e / np.linalg.norm(e, axis=1, keepdims=True).clip(1e-12)
            for t, rs in sets.items():
                a = np.array([where[r["sentence1"]] for r in rs])
                b = np.array([where[r["sentence2"]] for r in rs])
                gold = np.array([float(r["score"]) for r in rs])
                rows[t] = {
                    "spearman_x100": 100 * spearman((e[a] * e[b]).sum(1), gold),
                    "seconds": seconds,
                    "texts": len(sentences),
                    "tokens": tokens,
                    "reused": False,
                }
        fields = ("spearman_x100", "seconds", "texts", "tokens", "reused")
        return [{**{k: rows[t].get(k) for k in fields}, "task": t, "key": keys[t]} for t in tasks]


def evaluate_variants(scorer: Scorer, out: Path, names: list[str], heldout: bool):
    """One row per (variant, task): STSBenchmark test for every variant, the held-out sets too for the variants
    marked ``heldout`` when ``heldout`` is set."""
    import pandas as pd

    rows = []
    for name in names:
        knobs = variants(out)[name]
        tasks = ["STSBenchmark", *(HELD_OUT if heldout and VARIANTS[name].get("heldout") else ())]
        for r in scorer.score(knobs, tasks):
            rows.append(
                {
                    "variant": name,
                    "task": r["task"],
                    "spearman_x100": r["spearman_x100"],
                    "bidirectional": knobs["bidirectional"],
                    "adapters": "+".join(VARIANTS[name]["adapters"]) or "none",
                    "template": VARIANTS[name].get("template") or "",
                    "pooling": knobs["pooling"],
                    "seconds": r["seconds"],
                    "texts": r["texts"],
                    "tokens": r["tokens"],
                    "key": r["key"],
                    "reused": r["reused"],
                }
            )
            print(f"  {name:32s} {r['task']:13s} {r['spearman_x100']:6.2f}{'  (reused)' * r['reused']}", flush=True)
    return pd.DataFrame(rows)


def layer_sweep(scorer: Scorer, out: Path, names: list[str], layers: list[int]):
    """Spearman x100 on STSBenchmark test after each of ``layers`` (``Engine(layer=k)``: only k layers run)."""
    import pandas as pd

    rows = []
    for name in names:
        for k in layers:
            r = scorer.score(variants(out)[name], ["STSBenchmark"], layer=k)[0]
            rows.append(
                {
                    "variant": name,
                    "layer": k,
                    "spearman_x100": r["spearman_x100"],
                    "seconds": r["seconds"],
                    "key": r["key"],
                    "reused": r["reused"],
                }
            )
            print(f"  {name:32s} layer {k:2d}: {r['spearman_x100']:6.2f}{'  (reused)' * r['reused']}", flush=True)
    scorer.eng.configure(layer=None)
    return pd.DataFrame(rows, columns=["variant", "layer", "spearman_x100", "seconds", "key", "reused"])
