"""Bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lab import Engine


def test_bare_string_says_pass_a_list(minilm_engine):
    with pytest.raises(TypeError, match="list of strings.*single str"):
        minilm_engine.embed("A man plays a guitar.")


def test_non_string_item_names_its_index(minilm_engine):
    with pytest.raises(TypeError, match=r"texts\[2\] is int"):
        minilm_engine.embed(["a", "b", 3])
    with pytest.raises(TypeError, match=r"texts\[0\] is NoneType"):
        minilm_engine.embed([None])


@pytest.mark.parametrize(
    "knob,value,match",
    [
        ("pooling", "avg", "unknown pooling 'avg'; valid: cls, mean, max, lasttoken, weightedmean"),
        ("dtype", "float8", "unknown dtype 'float8'; valid: auto, float32, bfloat16, float16"),
        ("device", "tpu", "unknown device 'tpu'; valid: auto, cpu, cuda"),
        ("attention_backend", "flash", "unknown attention_backend 'flash'; valid: auto, torch, triton"),
        ("max_batch_tokens", 0, "max_batch_tokens must be a positive int"),
        ("truncate_dim", -3, "truncate_dim must be a positive int"),
        ("cpu_workers", 0, "cpu_workers must be a positive int or None"),
    ],
)
def test_unknown_knob_values_list_valid_ones(minilm_path, minilm_engine, knob, value, match):
    with pytest.raises(ValueError, match=match):
        Engine(minilm_path, **{knob: value})
    before = dict(minilm_engine.knobs)
    if knob != "device":
        with pytest.raises(ValueError, match=match):
            minilm_engine.configure(**{knob: value})
        assert minilm_engine.knobs == before  # a failed configure changes nothing


def test_unknown_knob_name(minilm_engine):
    with pytest.raises(TypeError, match="unknown knob.*poolin.*valid knobs"):
        minilm_engine.configure(poolin="mean")


def test_bool_knob_type(minilm_engine):
    with pytest.raises(TypeError, match="normalize must be True, False or None"):
        minilm_engine.configure(normalize="yes")


def test_device_is_not_live(minilm_engine):
    with pytest.raises(ValueError, match="cannot change live"):
        minilm_engine.configure(device="cuda")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(str(tmp_path))


def test_folder_without_weights(tmp_path, minilm_path):
    shutil.copy(f"{minilm_path}/config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights.*model.safetensors"):
        Engine(str(tmp_path))


def test_folder_without_tokenizer(tmp_path, minilm_path):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{minilm_path}/{f}", tmp_path / f)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        Engine(str(tmp_path))


def test_pytorch_bin_loads_with_a_warning(tmp_path, minilm_path, minilm_engine):
    import torch
    from safetensors.torch import load_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{minilm_path}/{f}", tmp_path / f)
    torch.save(load_file(f"{minilm_path}/model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.warns(UserWarning, match="pytorch_model.bin"):
        eng = Engine(str(tmp_path), pooling="mean", normalize=True)
    import numpy as np

    np.testing.assert_allclose(eng.embed(["hello world"]), minilm_engine.embed(["hello world"]), atol=1e-6)


def test_wrong_model_type(minilm_path):
    with pytest.raises(TypeError, match="a local model folder or a hub id"):
        Engine(123)


def test_unsupported_position_embedding(tmp_path, minilm_path):
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(f"{minilm_path}/{f}", tmp_path / f)
    cfg = json.loads(Path(minilm_path, "config.json").read_text())
    cfg["position_embedding_type"] = "relative_key"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="relative_key.*not implemented"):
        Engine(str(tmp_path))


def test_warnings_name_the_line_that_called_the_engine(minilm_path, tmp_path):
    """A warning raised deep inside the package (a stray weight file while loading, a truncation after a call)
    points at the caller's line, here: Python's "once per location" filters then count it where the user sees it."""
    folder = tmp_path / "with-stray-weights"
    shutil.copytree(minilm_path, folder)
    (folder / "stale.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning, match="stale.safetensors are not read") as loading:
        eng = Engine(str(folder), max_length=4)
    with pytest.warns(UserWarning, match="were truncated") as calling:
        eng.embed(["one two three four five six seven"])
    for record in [*loading, *calling]:
        assert record.filename == __file__, (str(record.message)[:60], record.filename)
