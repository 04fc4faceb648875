"""MTEB results the leaderboard takes: mteb's standard ResultCache layout for the plain run, variants filed apart,
model_meta.json filled from the model, resumable runs, unavailable tasks skipped with their reason, benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab._repo import import_evals

import_evals()  # the repository's evals/ package, without the repo root on sys.path

mteb = pytest.importorskip("mteb")

from test_evaluate import FakeEngine

from evals import run as cli
from evals.tasks import get_task, get_tasks
from lab.eval.model_card import card_fields, front_matter, read_card
from lab.eval.mteb_adapter import as_mteb_model, knobs_set, model_name, model_revision, resolve_tasks
from lab.eval.sweeps import evaluate, task_table

MB = 1024**2


def _revision_folder(cache: Path, engine) -> Path:
    return cache / "results" / model_name(engine).replace("/", "__") / model_revision(engine)


def _engine_at(folder: Path) -> FakeEngine:
    eng = FakeEngine()
    eng.model_path = str(folder)
    return eng


def _plain_files(cache: Path) -> list[Path]:
    return [
        p for p in (cache / "results").rglob("*.json") if "experiments" not in p.parts and p.name != "model_meta.json"
    ]


# ------------------------------------------------------------------------------------------------- model card
def test_front_matter_of_a_written_card(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nlanguage:\n- en\n- de\n- not-a-language\nlicense: MIT\nrelease_date: 2024-05-01\ntags:\n- x\n---\n"
        "\n# A model\n\n---\nnot: front matter\n---\n",
        encoding="utf-8",
    )
    card = read_card(tmp_path)
    assert card["license"] == "MIT" and card["tags"] == ["x"] and "not" not in card
    assert card_fields(card) == {"license": "mit", "languages": ["deu-Latn", "eng-Latn"], "release_date": "2024-05-01"}
    assert front_matter("# no front matter\n---\nlicense: mit\n---\n") == {}
    assert front_matter("---\n: [unclosed\n---\n") == {}  # not YAML: no fields, no error
    assert card_fields({"license": "other", "language": "xx-nowhere"}) == {}
    assert read_card(tmp_path / "missing") == {}


def test_card_value_mteb_refuses_is_left_out(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("---\nlicense: my-own-terms\nlanguage: en\n---\n", encoding="utf-8")
    meta = as_mteb_model(_engine_at(tmp_path)).mteb_model_meta
    assert meta.license is None and meta.languages == ["eng-Latn"]


# ------------------------------------------------------------------------------------------- plain run layout
def test_plain_run_round_trip_through_result_cache(minilm_engine, tmp_path):
    """The bundled all-MiniLM-L6-v2 at its defaults: mteb's standard folder, read back by load_results with the
    model meta filled from the model and its card; the per-task table has the run's tokens/s."""
    before = minilm_engine.knobs
    df = evaluate(minilm_engine, get_tasks(["STSBenchmark"], limit=20), cache=tmp_path, show_progress=False)
    assert minilm_engine.knobs == before
    folder = _revision_folder(tmp_path, minilm_engine)
    assert (folder / "STSBenchmark.n20.json").is_file() and (folder / "model_meta.json").is_file()
    assert not list(tmp_path.rglob("experiments"))  # the plain run: no experiment folder

    name, revision = model_name(minilm_engine), model_revision(minilm_engine)
    results = mteb.ResultCache(tmp_path).load_results(models=[name], include_remote=False)
    assert [(r.model_name, r.model_revision, r.experiment_name) for r in results] == [(name, revision, None)]
    loaded = results[0]
    assert [t.task_name for t in loaded.task_results] == ["STSBenchmark.n20"]
    score = df[df["main"]]["score"].item()
    assert loaded.task_results[0].get_score() == pytest.approx(score, abs=1e-4)

    meta = json.loads((folder / "model_meta.json").read_text())
    n = sum(p.numel() for p in minilm_engine.model.parameters())
    assert meta["name"] == name and meta["revision"] == revision and meta["experiment_kwargs"] is None
    assert meta["n_parameters"] == n and meta["memory_usage_mb"] == round(n * 4 / MB)
    assert meta["embed_dim"] == 384 and meta["max_tokens"] == 256 and meta["similarity_fn_name"] == "cosine"
    assert meta["license"] == "apache-2.0" and meta["languages"] == ["eng-Latn"]  # from the folder's README.md
    assert meta["reference"] is None  # a local folder has no hub page
    assert loaded.model_meta is not None and loaded.model_meta.n_parameters == n

    tasks = task_table(df)
    assert tasks[["task", "status"]].values.tolist() == [["STSBenchmark.n20", "computed"]]
    assert tasks["tokens"].item() > 0 and tasks["tokens_per_s"].item() > 0
    assert tasks["score"].item() == pytest.approx(score)


def test_hub_id_gets_its_hub_page_as_reference():
    eng = FakeEngine()  # named fake/bag-of-words, as a hub id is
    assert as_mteb_model(eng).mteb_model_meta.reference == "https://huggingface.co/fake/bag-of-words"
    eng.model_name = "local/my-model"
    assert as_mteb_model(eng).mteb_model_meta.reference is None


def test_variant_is_filed_apart_and_never_overwrites_the_plain_run(tmp_path):
    eng = FakeEngine()
    task = get_task("STSBenchmark", limit=20)
    plain = evaluate(eng, [task], cache=tmp_path, show_progress=False)
    (plain_file,) = _plain_files(tmp_path)
    assert plain_file.parent.name == model_revision(eng) and plain_file.name == "STSBenchmark.n20.json"
    text = plain_file.read_text()

    swept = evaluate(eng, [task], sweep={"pooling": ["cls"]}, cache=tmp_path, show_progress=False)
    eng.configure(bidirectional=True)  # a knob set away from its default: a variant too
    set_away = evaluate(eng, [task], cache=tmp_path, show_progress=False)
    eng.configure(bidirectional=None)
    assert plain_file.read_text() == text and _plain_files(tmp_path) == [plain_file]
    variants = {p.parent.name for p in (tmp_path / "results").rglob("STSBenchmark.n20.json") if p != plain_file}
    assert len(variants) == 2 and all(
        "experiments" == p.parent.parent.name
        for p in (tmp_path / "results").rglob("STSBenchmark.n20.json")
        if p != plain_file
    )
    assert any("pooling_cls" in v for v in variants) and any("bidirectional_True" in v for v in variants)
    scores = [d[d["main"]]["score"].item() for d in (plain, swept, set_away)]
    assert len(set(scores)) == 3

    cache = mteb.ResultCache(tmp_path)
    plain_only = cache.load_results(models=[model_name(eng)], include_remote=False)
    assert [r.experiment_name for r in plain_only] == [None]
    everything = cache.load_results(models=[model_name(eng)], include_remote=False, load_experiments="match_name")
    assert len(everything.model_results) == 3

    again = evaluate(eng, [task], cache=tmp_path, show_progress=False)  # the plain run, served from its folder
    assert task_table(again)["status"].tolist() == ["cached"]
    assert again[again["main"]]["score"].item() == pytest.approx(scores[0], abs=1e-4)  # as stored


def test_knobs_that_run_as_the_defaults_are_the_plain_run(minilm_engine):
    before = minilm_engine.knobs
    try:
        assert knobs_set(minilm_engine) == {}
        minilm_engine.configure(layer=-1, max_batch_tokens=4096, adapters=[])  # last layer; scheduling only
        assert knobs_set(minilm_engine) == {}
        assert as_mteb_model(minilm_engine).mteb_model_meta.experiment_kwargs is None
        minilm_engine.configure(layer=3)
        assert knobs_set(minilm_engine) == {"layer": 3}
        assert as_mteb_model(minilm_engine).mteb_model_meta.experiment_kwargs["layer"] == 3
        minilm_engine.configure(layer=None, pooling="mean")  # the model's own pooling, but set: a variant
        assert as_mteb_model(minilm_engine).mteb_model_meta.experiment_kwargs["pooling"] == "mean"
    finally:
        minilm_engine.configure(**{k: before[k] for k in ("layer", "pooling", "max_batch_tokens", "adapters")})


def test_prompts_other_than_the_models_own_make_a_variant(tmp_path):
    (tmp_path / "config_sentence_transformers.json").write_text('{"prompts": {"query": "query: "}}')
    eng = _engine_at(tmp_path)
    assert as_mteb_model(eng).mteb_model_meta.experiment_kwargs is None  # the model's own prompts
    assert as_mteb_model(eng, instructions={"query": "query: "}).mteb_model_meta.experiment_kwargs is None
    other = as_mteb_model(eng, instructions={"query": "Q: "}).mteb_model_meta.experiment_kwargs
    assert other["prompts"] == {"query": "Q: "}
    assert as_mteb_model(eng, use_task_instructions=True).mteb_model_meta.experiment_kwargs["task_instructions"]


# ---------------------------------------------------------------------------------------------- resume, skip
def test_resume_redoes_only_the_missing_task(tmp_path):
    eng = FakeEngine()
    tasks = get_tasks(["STSBenchmark", "SICK-R"], limit=20)
    evaluate(eng, tasks, cache=tmp_path, show_progress=False)
    first = eng.n_embed
    assert first == 4  # two columns a task, one embed call each
    (_revision_folder(tmp_path, eng) / "SICK-R.n20.json").unlink()  # as if the run was killed before SICK-R

    df = evaluate(eng, get_tasks(["STSBenchmark", "SICK-R"], limit=20), cache=tmp_path, show_progress=False)
    assert eng.n_embed == first + 2  # SICK-R only
    assert task_table(df)[["task", "status"]].values.tolist() == [
        ["STSBenchmark.n20", "cached"],
        ["SICK-R.n20", "computed"],
    ]
    assert set(df[df["main"]]["task"]) == {"STSBenchmark.n20", "SICK-R.n20"}


def test_unavailable_task_is_skipped_with_its_reason_while_the_others_run(tmp_path):
    eng = FakeEngine()
    hub_only = mteb.get_task("BIOSSES")  # no local copy; offline and not in the datasets cache
    df = evaluate(eng, [hub_only, get_task("STSBenchmark", limit=20)], cache=tmp_path, show_progress=False)
    tasks = task_table(df).set_index("task")
    assert tasks.loc["BIOSSES", "status"] == "skipped"
    assert "data not available" in tasks.loc["BIOSSES", "reason"] and "biosses" in tasks.loc["BIOSSES", "reason"]
    assert tasks.loc["STSBenchmark.n20", "status"] == "computed" and tasks.loc["STSBenchmark.n20", "reason"] == ""
    assert set(df["task"]) == {"STSBenchmark.n20"}  # a skipped task has no score rows
    assert "load_data" not in vars(hub_only)  # the task is left as it was


def test_a_failing_model_is_not_taken_for_missing_data():
    eng = FakeEngine()

    def broken(*a, **k):
        raise RuntimeError("model broke")

    eng.embed = broken
    with pytest.raises(RuntimeError, match="model broke"):
        evaluate(eng, [get_task("STSBenchmark", limit=10)], cache=None, show_progress=False)


# ------------------------------------------------------------------------------------------------- benchmarks
def test_benchmark_names_and_objects_resolve_to_their_tasks():
    bench = mteb.get_benchmark("FollowIR")
    names = [t.metadata.name for t in bench.tasks]
    assert [t.metadata.name for t in resolve_tasks("FollowIR")] == names
    assert [t.metadata.name for t in resolve_tasks(bench)] == names
    (sts,) = resolve_tasks("STSBenchmark")  # a task name stays a task (the local copy)
    assert type(sts).__module__ == "evals.tasks"


def test_cli_benchmark_and_task_arguments():
    args = cli.build_parser().parse_args(["--model", "org/name", "--revision", "abc", "--benchmark", "MTEB(eng, v2)"])
    assert args.benchmark == "MTEB(eng, v2)" and args.tasks is None and args.revision == "abc"
    for argv in (["--model", "m"], ["--model", "m", "--tasks", "STS12", "--benchmark", "FollowIR"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--benchmark", "FollowIR", "--limit", "10"], "--limit"),
        (["--benchmark", "No Such Benchmark"], "No Such Benchmark"),
    ],
)
def test_cli_refuses_benchmark_misuse(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--model", "unused", *argv], engine=FakeEngine())
    assert message in capsys.readouterr().err


def test_cli_benchmark_offline_every_task_skipped_with_reasons(tmp_path, capsys):
    df = cli.main(
        [
            "--model",
            "unused",
            "--benchmark",
            "MTEB(eng, v2)",
            "--out",
            str(tmp_path / "out"),
            "--cache",
            str(tmp_path / "cache"),
        ],
        engine=FakeEngine(),
    )
    tasks = task_table(df)
    assert len(tasks) == len(mteb.get_benchmark("MTEB(eng, v2)").tasks) and df.empty
    assert (tasks["status"] == "skipped").all() and tasks["reason"].str.contains("data not available").all()
    out = capsys.readouterr()
    assert "skipped" in out.out and "ArguAna" in out.out and "task runs skipped" in out.err
    (md,) = (tmp_path / "out").glob("*.md")
    assert "benchmark: MTEB(eng, v2)" in md.read_text() and "| ArguAna | skipped |" in md.read_text()
    assert not (tmp_path / "cache" / "results").exists() or not list((tmp_path / "cache").rglob("*.json"))


def test_cli_prints_the_per_task_table(tmp_path, capsys):
    cli.main(
        [
            "--model",
            "unused",
            "--tasks",
            "STSBenchmark",
            "--limit",
            "20",
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
        ],
        engine=FakeEngine(),
    )
    out = capsys.readouterr().out
    assert "STSBenchmark.n20" in out and "computed" in out and "tokens/s" in out
    (md,) = tmp_path.glob("*.md")
    assert "## Tasks" in md.read_text() and "| default | STSBenchmark.n20 | computed |" in md.read_text()


@pytest.mark.slow
def test_evals_run_by_hub_id_is_found_by_mteb_under_the_id_and_commit(minilm_path, tmp_path, monkeypatch):
    """``python -m evals.run --model <id>`` on a Hugging Face cache holding the model under its id (offline): mteb's
    own ``ResultCache.load_results`` finds ``(id, commit)`` with the model meta filled."""
    from hub_cache import write_hub_cache
    from huggingface_hub import constants

    model_id, commit = "sentence-transformers/all-MiniLM-L6-v2", "e" * 40
    write_hub_cache(tmp_path / "hf", model_id, Path(minilm_path), commit=commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    cli.main(
        [
            "--model",
            model_id,
            "--tasks",
            "STSBenchmark",
            "--limit",
            "30",
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    results = mteb.ResultCache(tmp_path / "cache").load_results(models=[model_id])
    [model] = results.model_results
    assert (model.model_name, model.model_revision) == (model_id, commit)
    meta = json.loads(
        (tmp_path / "cache" / "results" / model_id.replace("/", "__") / commit / "model_meta.json").read_text()
    )
    assert meta["n_parameters"] > 2e7 and meta["embed_dim"] == 384 and meta["max_tokens"] == 256
    assert meta["memory_usage_mb"] > 80 and meta["reference"] == f"https://huggingface.co/{model_id}"
