"""The LLM2Vec study's training text (``evals/llm2vec_study.py``), on the real data files: it shares no text with any
evaluation file, is deterministic and is the text the committed adapters were trained on; the newsgroup splitter
drops quotes, attributions, headers, signatures and URLs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from evals import llm2vec_study as study
from evals import llm2vec_study_recipe as recipe
from evals import llm2vec_study_report as report
from evals import llm2vec_study_text as train_text

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals" / "data"


def _fold(s: str) -> str:
    return " ".join(s.lower().split())


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, (list, dict)):
        for x in v.values() if isinstance(v, dict) else v:
            yield from _strings(x)


@pytest.fixture(scope="module")
def text():
    return train_text.training_texts()


def test_training_text_shares_no_sentence_with_any_evaluation_file(text):
    """Every string of every JSON-lines file under evals/data (bar the two training sources), read here on its own,
    and every sentence of it: none equals a training text, case- and space-folded."""
    texts, counts = text
    sources = {DATA / "twentynewsgroups" / "train.full.jsonl.gz", DATA / "banking77" / "train.jsonl.gz"}
    files = [p for p in DATA.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")) and p not in sources]
    names = {str(p.relative_to(DATA)) for p in files}
    for must in (
        "stsbenchmark/train.jsonl.gz",
        "stsbenchmark/validation.jsonl.gz",
        "stsbenchmark/test.jsonl.gz",
        "sts12/test.jsonl.gz",
        "sts14/test.jsonl.gz",
        "sts16/test.jsonl.gz",
        "sickr/train.jsonl.gz",
        "sickr/trial.jsonl.gz",
        "sickr/test.jsonl.gz",
        "banking77/test.jsonl.gz",
        "twentynewsgroups/test.subjects.jsonl.gz",
        "twitterurlcorpus/test.jsonl.gz",
        "twitterurlcorpus/test.reranking.jsonl.gz",
        "scifact/corpus.jsonl.gz",
        "scifact/queries.test.jsonl",
    ):
        assert must in names
    assert sorted(files) == train_text.evaluation_files()
    held = set()
    for f in files:
        with (gzip.open if f.suffix == ".gz" else open)(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                for s in _strings(json.loads(line)) if line.strip() else ():
                    held.add(_fold(s))
                    held.update(_fold(x) for x in train_text.post_sentences(s))
    assert len(held) > 50_000
    folded = [_fold(t) for t in texts]
    assert not set(folded) & held
    assert len(set(folded)) == len(texts) == counts["kept"] == sum(train_text.TEXT_MIX.values())


def test_training_text_is_the_committed_adapters_text(text):
    """The text is fixed by its seed: its fingerprint is the one every committed adapter's train_config.json records
    (the study checks it before reusing an adapter)."""
    texts, _ = text
    assert train_text.training_texts()[0] == texts
    for name in recipe.ADAPTERS:
        config = json.loads((study.DEFAULT_OUT / name / "train_config.json").read_text())
        assert config["texts_sha1"] == train_text.texts_sha1(texts), name
        assert config["texts"] == len(texts)


def test_a_finished_adapter_trained_on_other_text_is_refused(tmp_path):
    """train() reuses a finished adapter only when its train_config.json records this text and recipe."""
    texts, _ = train_text.training_texts()
    d = tmp_path / "mntp"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    config = {"texts_sha1": train_text.texts_sha1(texts[:-1]), "seed": 0, **recipe.RECIPE["mntp"]}
    (d / "train_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="other text or another recipe"):
        recipe.train(tmp_path, tmp_path, 0, {"mntp"})
    config["texts_sha1"] = train_text.texts_sha1(texts)
    (d / "train_config.json").write_text(json.dumps(config))
    assert recipe.train(tmp_path, tmp_path, 0, {"mntp"}) == {}


def test_post_sentences_keeps_prose_only():
    lines = [
        "Archive-name: space/faq",
        "In article <1993Apr5.1@foo.edu> bob@foo.edu writes:",
        "> The launch was delayed by three weeks because of the weather.",
        "",
        "I think the launch was delayed for a different reason entirely. The engineers",
        "found a crack in the main fuel line during the last inspection! See",
        "http://example.com for the full report on the inspection results today.",
        "Mr. Smith said so.",
        "Name        Mass        Orbit",
        "Too short.",
        "",
        "--",
        "Bob, whose signature line is long enough to be a sentence by itself.",
    ]
    body = "\n".join(lines)
    assert train_text.post_sentences(body) == [
        "I think the launch was delayed for a different reason entirely.",
        "The engineers found a crack in the main fuel line during the last inspection!",
    ]


def test_an_unknown_training_source_is_refused(monkeypatch):
    monkeypatch.setattr(train_text, "TEXT_MIX", {"twentynewsgroups": 10, "wikipedia": 10})
    with pytest.raises(ValueError, match=r"TEXT_MIX names \['wikipedia'\]"):
        train_text.training_texts()


def test_mix_label_names_each_source_drawn():
    assert train_text.mix_label({"twentynewsgroups": 4000, "banking77": 1000}) == "20NG 4,000 + Banking77 1,000"
    assert train_text.mix_label({"twentynewsgroups": 5000, "banking77": 0}) == "20NG 5,000"


def _results(scores):
    import pandas as pd

    return pd.DataFrame([{"variant": v, "task": t, "spearman_x100": x} for (v, t), x in scores.items()])


def test_report_sets_every_training_text_side_by_side():
    """comparison_lines: a trained variant gets one row per training text (the earlier ones, then ``TEXT_MIX``), an
    untrained one a single row; each text's target line says met or short from its own gains."""
    base = {("causal base", t): 40.0 for t in report.TARGETS}
    current = _results(
        {
            **base,
            **{(report.TARGET_VARIANT, t): 40.0 + g + 1 for t, g in report.TARGETS.items()},
            ("causal echo", "STSBenchmark"): 55.0,
        }
    )
    short = _results({**base, **{(report.TARGET_VARIANT, t): 40.0 + g - 1 for t, g in report.TARGETS.items()}})
    label = train_text.mix_label(train_text.TEXT_MIX)
    lines = report.comparison_lines(current, {"earlier text": short})
    rows = [line for line in lines if line.startswith(f"| {report.TARGET_VARIANT} |")]
    assert [r.split(" | ")[1] for r in rows] == ["earlier text", label] * 2  # scores, then gains
    assert rows[2].endswith(" | ".join(f"{g - 1:+.2f}" for g in report.TARGETS.values()) + " |")
    assert sum(line.startswith("| causal echo | none (not trained) |") for line in lines) == 2
    targets = {line[2:].split(":")[0]: line for line in lines if line.startswith("- ") and "target +" in line}
    assert targets["earlier text"].count("short") == len(report.TARGETS) and "met" not in targets["earlier text"]
    assert targets[label].count("met") == len(report.TARGETS) and "short" not in targets[label]
    assert "largest difference 0.0000 points over 5 scores" in "\n".join(lines)


def test_compared_tables_are_committed():
    """Every earlier training text the study compares with has its tables in the committed results folder."""
    for label, (results, layers, what) in report.COMPARED.items():
        assert (study.DEFAULT_OUT / results).exists(), label
        assert layers is None or (study.DEFAULT_OUT / layers).exists(), label
        assert what


def test_seed_runs_reads_each_other_seed_folder(tmp_path):
    """seed_runs: this run's table under its seed, then each ``seed<N>/results.csv`` of another seed, in seed order;
    other folders, a folder without a table and a folder of this run's own seed are not read."""
    this = _results({("causal base", "STS12"): 40.0})
    for name, score in (("seed2", 2.0), ("seed1", 1.0), ("seedx", 9.0), ("seed0", 9.0), ("old", 9.0)):
        (tmp_path / name).mkdir()
        _results({("causal base", "STS12"): score}).to_csv(tmp_path / name / "results.csv", index=False)
    (tmp_path / "seed3").mkdir()
    runs = report.seed_runs(tmp_path, 0, this)
    assert list(runs) == [0, 1, 2]
    assert runs[0] is this and [r.spearman_x100[0] for r in (runs[1], runs[2])] == [1.0, 2.0]


def test_seed_lines_give_every_seed_the_mean_and_the_targets_on_the_mean(tmp_path):
    """seed_lines: one gain row per seed for each trained variant, then the mean and the spread; the targets are
    judged on the mean (one seed short, the mean met); the target variant over the control per seed; nothing for a
    single seed. seed_plot draws them."""
    base = {("causal base", t): 40.0 for t in report.TARGETS}
    offsets = {0: -0.5, 1: 1.5}  # seed 0 short of every target by 0.5, seed 1 over by 1.5: mean over by 0.5
    runs = {
        s: _results(
            {
                **base,
                **{(report.TARGET_VARIANT, t): 40.0 + g + d for t, g in report.TARGETS.items()},
                **{(report.CONTROL, t): 45.0 for t in report.TARGETS},
                ("causal echo", "STS12"): 50.0,
            }
        )
        for s, d in offsets.items()
    }
    assert report.seed_lines({0: runs[0]}) == []
    lines = report.seed_lines(runs)
    rows = {line.split(" | ")[1]: line for line in lines if line.startswith(f"| {report.TARGET_VARIANT} |")}
    assert list(rows) == ["0", "1", "mean of 2", "spread"]
    assert rows["0"].endswith(" | ".join(f"{g - 0.5:+.2f}" for g in report.TARGETS.values()) + " |")
    assert rows["mean of 2"].endswith(" | ".join(f"{g + 0.5:+.2f}" for g in report.TARGETS.values()) + " |")
    assert rows["spread"].endswith(" | ".join("2.00" for _ in report.TARGETS) + " |")
    assert not any(line.startswith("| causal echo |") for line in lines)  # untrained: the same in every seed
    target = next(line for line in lines if line.startswith("Targets on the mean of 2 seeds"))
    assert target.count("met") == len(report.TARGETS) and "short" not in target
    each = next(line for line in lines if line.startswith("Each seed on its own"))
    first = f"seed 0 short on STSBenchmark {report.TARGETS['STSBenchmark'] - 0.5:+.2f}"
    assert each.startswith(f"Each seed on its own: {first}")
    assert each.endswith("; seed 1 meets every target.")
    partial = {**runs, 2: runs[1][runs[1].task != "SICK-R"], 3: runs[1][runs[1].variant != report.TARGET_VARIANT]}
    each = next(line for line in report.seed_lines(partial) if line.startswith("Each seed on its own"))
    assert each.endswith("; seed 2 not scored on SICK-R; seed 3 not scored on " + ", ".join(report.TARGETS) + ".")
    over = next(line for line in lines if line.startswith(f"{report.TARGET_VARIANT} over {report.CONTROL}"))
    g = report.TARGETS["STS12"]
    assert f"STS12 {g - 5.5:+.2f} / {g - 3.5:+.2f} (mean {g - 4.5:+.2f})" in over
    report.seed_plot({s: r[r.variant == "causal base"] for s, r in runs.items()}, tmp_path)
    assert not (tmp_path / "seeds.png").exists()  # no trained variant: nothing to draw
    report.seed_plot(runs, tmp_path)
    assert (tmp_path / "seeds.png").stat().st_size > 10_000


def test_committed_seed_folders_hold_that_seed_on_this_text(text):
    """Each ``seed<N>/`` of the study was trained with seed N on the study's text and recipe (its adapters'
    train_config.json), and scored every held-out set for the target variant."""
    import pandas as pd

    folders = [d for d in study.DEFAULT_OUT.iterdir() if report._SEED_DIR.fullmatch(d.name)]
    assert folders
    for d in folders:
        for name, (objective, _, _) in recipe.ADAPTERS.items():
            config = json.loads((d / name / "train_config.json").read_text())
            assert config["seed"] == int(d.name[4:]) != 0, d
            assert config["texts_sha1"] == train_text.texts_sha1(text[0]), d
            assert {k: config[k] for k in recipe.RECIPE[objective]} == recipe.RECIPE[objective], d
        results = pd.read_csv(d / "results.csv")
        assert set(results[results.variant == report.TARGET_VARIANT].task) == set(report.TARGETS), d
