"""``evals/llm2vec_parity.py``'s plain rows: the folders they lay out and how each side is called (no llm2vec venv,
no model: tiny stand-in folders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals import llm2vec_parity as parity
from evals import llm2vec_parity_folders as parity_folders
from evals import llm2vec_parity_variants as variants
from lab.engine.framing import CHAT_TEMPLATES


def _write(folder: Path, files: dict[str, object]) -> Path:
    folder.mkdir(parents=True)
    for name, body in files.items():
        (folder / name).write_text(body if isinstance(body, str) else json.dumps(body))
    return folder


@pytest.fixture
def folders(tmp_path):
    base = _write(
        tmp_path / "base",
        {
            "config.json": {"model_type": "llama", "_name_or_path": "somewhere"},
            "tokenizer.json": "{}",
            "tokenizer_config.json": "{}",
            "model.safetensors": "weights",
        },
    )
    adapter = {
        "adapter_config.json": {"base_model_name_or_path": "/trained/on", "peft_type": "LORA"},
        "adapter_model.safetensors": "lora",
        "llm2vec_config.json": {"pooling_mode": "mean"},
    }
    return {"base": base, "mntp:bare": _write(tmp_path / "m", adapter), "simcse:bare": _write(tmp_path / "s", adapter)}


def test_plain_rows_pass_no_settings():
    plain = [v for v in variants.VARIANTS if v.plain]
    assert plain and all(not v.knobs and v.bidirectional for v in plain)
    assert len({v.name for v in variants.VARIANTS}) == len(variants.VARIANTS)
    assert set(parity.PLAIN_KNOBS) == {"dtype", "device"}
    # every chat template llm2vec 0.2.3 chooses by name has a row
    assert set(variants.TEMPLATED) == set(CHAT_TEMPLATES)
    assert {v.name_or_path for v in plain} >= set(CHAT_TEMPLATES)


def test_llm2vec_job_of_a_plain_row_has_no_settings(tmp_path, monkeypatch, folders):
    jobs = []

    def fake_run(cmd, **kw):
        jobs.append(json.loads(Path(cmd[-1]).read_text()))
        raise SystemExit  # the job is all this test reads

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    v = variants.published("row")
    with pytest.raises(SystemExit):
        parity.run_llm2vec(Path("python"), v, ("mntp", "sup"), ["a"], tmp_path)
    assert {"bidirectional", "encoder", "merge_peft"}.isdisjoint(jobs[0])
    assert (jobs[0]["model"], jobs[0]["peft"]) == ("mntp", "sup")


def test_published_layout_by_path(tmp_path, folders):
    v = variants.published("row", name_or_path="meta-llama/Meta-Llama-3-8B-Instruct", peft_config={"max_length": 128})
    mntp, sup = map(Path, parity_folders.published_folders(v, folders, tmp_path, tmp_path / "hub"))
    config = json.loads((mntp / "config.json").read_text())
    assert config["_name_or_path"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert config["auto_map"]["AutoModel"] == "modeling_llama_encoder.LlamaEncoderModel"
    assert (mntp / "tokenizer.json").is_file() and not (mntp / "llm2vec_config.json").exists()
    assert json.loads((mntp / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        folders["base"].resolve()
    )
    assert json.loads((sup / "adapter_config.json").read_text())["base_model_name_or_path"] == str(mntp)
    assert json.loads((sup / "llm2vec_config.json").read_text()) == {"max_length": 128}


def test_published_layout_by_hub_id(tmp_path, folders):
    v = variants.published(
        "row", peft=None, mntp_config={"pooling_mode": "eos_token"}, hub=("McGill-NLP/LLM2Vec-X-mntp", "org/base")
    )
    names = parity_folders.published_folders(v, folders, tmp_path, tmp_path / "hub")
    assert names == ("McGill-NLP/LLM2Vec-X-mntp", None)
    for repo in ("McGill-NLP/LLM2Vec-X-mntp", "McGill-NLP/LLM2Vec-X-mntp-supervised", "org/base"):
        top = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))
        commit = (top / "refs" / "main").read_text()
        assert (
            top / "snapshots" / commit / ("config.json" if repo == "org/base" else "adapter_config.json")
        ).is_file()
    snap = next((tmp_path / "hub" / "models--McGill-NLP--LLM2Vec-X-mntp" / "snapshots").iterdir())
    assert json.loads((snap / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"
    assert json.loads((snap / "llm2vec_config.json").read_text()) == {"pooling_mode": "eos_token"}


def test_scifact_rows_read_long_abstracts():
    docs = parity.texts_for(variants.published("row", texts="scifact"), [], 5)
    assert len(docs) == 5 and min(len(d.split()) for d in docs) > 200
    assert parity.texts_for(variants.published("row"), ["s"], 5) == ["s"]
