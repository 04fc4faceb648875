"""Model folders whose config, weight files or adapters cannot be right are refused before anything is built or
merged, with an error that names the file (and the key or tensor) and what was expected: a config asking for layers
the checkpoint lacks (fast, without allocating them), impossible sizes and RoPE / norm settings, stale weight files
beside the real ones, pickle weights, truncated or garbage safetensors / GGUF files, bad adapter and
sentence-transformers configs, tensors of the wrong shape, and NaN / Inf in weights or adapters.

The checkpoints are tiny random ones (``tiny_models`` / ``tiny_encoders``) whose files are then edited."""

from __future__ import annotations

import datetime
import json
import re
import resource
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_encoders import tiny_encoder
from tiny_models import tiny_llama

from lab import Engine as _Engine
from lab.adapt.adapters import read_adapter


def Engine(*args, **kw) -> _Engine:
    return _Engine(*args, **{"device": "cpu", **kw})


TEXTS = ["The quick brown fox jumps over the lazy dog.", "a", "What is the capital of France?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("loading")
    return {"bert": tiny_encoder(root / "bert", minilm_path, "bert"), "llama": tiny_llama(root, "llama")}


def _copy(models, kind: str, dest: Path) -> Path:
    shutil.copytree(models[kind], dest)
    return dest


def _edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _edit_weights(folder: Path, edit) -> Path:
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f), metadata={"format": "pt"})
    return folder


@contextmanager
def _within(seconds: float):
    """Fail (rather than run on for minutes, allocating) when the block takes longer than ``seconds``; also fail
    when it raises the process's peak memory by more than 300 MB."""

    def late(*_):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown < 300, f"peak memory grew by {grown:.0f} MB"


# ------------------------------------------------------------------------------------- 1. config vs checkpoint
LAYER_PREFIX = {"bert": "encoder.layer.2.", "llama": "model.layers.2."}


@pytest.mark.parametrize(
    "kind, weights", [("bert", "model.safetensors"), ("llama", "model.safetensors"), ("bert", "pytorch_model.bin")]
)
def test_a_config_with_layers_the_checkpoint_lacks_fails_at_once(models, kind, weights, tmp_path):
    """num_hidden_layers: 1000000 over a 2-layer checkpoint fails at the first missing layer, before allocating."""
    folder = _edit_config(_copy(models, kind, tmp_path / kind), num_hidden_layers=1_000_000)
    if weights.endswith(".bin"):
        torch.save(load_file(str(folder / "model.safetensors")), folder / weights)
        (folder / "model.safetensors").unlink()
    start = time.perf_counter()
    with _within(5), pytest.raises(ValueError) as e:
        Engine(str(folder))
    assert time.perf_counter() - start < 2
    msg = str(e.value)
    assert "num_hidden_layers=1000000" in msg and "no weights of layer 2" in msg, msg
    assert f"'{LAYER_PREFIX[kind]}*'" in msg and str(folder / weights) in msg, msg


@pytest.mark.parametrize(
    "kind, changes, match",
    [
        ("llama", {"num_key_value_heads": 0}, r"config.json: num_key_value_heads must be a positive integer, got 0"),
        ("llama", {"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (
            "llama",
            {"vocab_size": 10**12},
            (
                r"config.json: vocab_size=1000000000000 and hidden_size=64 ask for a weight "
                r"matrix of 6.4e\+13 elements"
            ),
        ),
        ("bert", {"vocab_size": 10**12}, r"config.json: vocab_size=1000000000000 and hidden_size=48"),
        (
            "bert",
            {"vocab_size": 30000},
            (
                r"config.json: vocab_size=30000 and hidden_size=48 ask for a word embedding of "
                r"shape \(30000, 48\), but .*model.safetensors holds "
                r"'embeddings.word_embeddings.weight' of shape \(30522, 48\)"
            ),
        ),
        ("bert", {"intermediate_size": 2**40}, r"config.json: intermediate_size=1099511627776 and hidden_size=48"),
        (
            "bert",
            {"intermediate_size": 10**9},
            (
                r"config.json: intermediate_size=1000000000 and hidden_size=48 ask for a "
                r"weight matrix of 4.8e\+10 elements, 179 GiB in float32 \(the limit is "
                r"8.59e\+09 elements, 32 GiB\).*fix intermediate_size \(or hidden_size\)"
            ),
        ),
        (
            "bert",
            {"type_vocab_size": 10**10},
            (
                r"config.json: type_vocab_size=10000000000 and hidden_size=48 ask for a "
                r"weight matrix of 4.8e\+11 elements, 1.75 TiB in float32"
            ),
        ),
        (
            "llama",
            {"intermediate_size": 10**9},
            r"config.json: intermediate_size=1000000000 and hidden_size=64 .*238 GiB",
        ),
        ("llama", {"rope_theta": 0}, r"config.json: rope_theta must be a finite number above 0, got 0"),
        ("llama", {"rope_theta": -10000.0}, r"config.json: rope_theta must be a finite number above 0"),
        ("llama", {"rms_norm_eps": -1e-6}, r"config.json: rms_norm_eps must be a finite number >= 0 .*got -1e-06"),
        ("llama", {"rms_norm_eps": "1e-6"}, r"config.json: rms_norm_eps must be a finite number >= 0"),
        ("bert", {"layer_norm_eps": -1e-12}, r"config.json: layer_norm_eps must be a finite number >= 0"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 128}},
            r"config.json: rope_scaling.factor \(yarn scaling\) must be a finite number above 0, got 0.0",
        ),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 128}},
            r"rope_scaling.factor \(yarn scaling\) must be a finite number above 0, got -4.0",
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope_scaling.factor \(linear scaling\)"),
        (
            "llama",
            {"rope_scaling": [2.0]},
            r"config.json: rope_scaling must be a JSON object of RoPE settings or null",
        ),
    ],
)
def test_config_values_that_cannot_be_right_name_the_key(models, kind, changes, match, tmp_path):
    folder = _edit_config(_copy(models, kind, tmp_path / kind), **changes)
    with _within(5), pytest.raises(ValueError, match=match):
        Engine(str(folder))


# --------------------------------------------------------------------------------------- 2. the weights file
def test_a_stale_weights_file_beside_model_safetensors_is_not_read(models, tmp_path):
    """model_old.safetensors sorts after model.safetensors; it is left unread, with a warning."""
    folder = _copy(models, "bert", tmp_path / "bert")
    sd = load_file(str(folder / "model.safetensors"))
    save_file({k: v * 0.5 for k, v in sd.items()}, str(folder / "model_old.safetensors"))
    with pytest.warns(
        UserWarning,
        match=r"weight file\(s\) model_old.safetensors are not read: the model's weights "
        r"are model.safetensors",
    ):
        eng = Engine(str(folder))
    np.testing.assert_array_equal(eng.embed(TEXTS), Engine(str(models["bert"])).embed(TEXTS))


@pytest.mark.parametrize("sharded", [False, True])
def test_the_hub_cache_layout_loads_sharded_or_not(models, tmp_path, sharded):
    """The Hugging Face hub cache keeps a snapshot's files as symbolic links to ``../../blobs``: one rule for the
    single file and the shards (the names must stay inside the folder; the files may be links), both load."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    src = models["bert"]
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, blobs / f.name)
            (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    sd = load_file(str(src / "model.safetensors"))
    if sharded:
        names = sorted(sd)
        parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for shard, keys in parts.items():
            save_file({k: sd[k] for k in keys}, str(blobs / shard))
            (snap / shard).symlink_to(Path("..", "..", "blobs", shard))
        (snap / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: shard for shard, keys in parts.items() for k in keys}})
        )
    else:
        shutil.copy(src / "model.safetensors", blobs / "model.safetensors")
        (snap / "model.safetensors").symlink_to(Path("..", "..", "blobs", "model.safetensors"))
    np.testing.assert_array_equal(Engine(str(snap)).embed(TEXTS), Engine(str(src)).embed(TEXTS))


def test_a_shard_linked_out_of_the_folder_is_refused_naming_it(models, tmp_path):
    """A shard index may name a link, as the hub cache does (``../../blobs``), but not one that leaves the folder
    for a file elsewhere: that is refused naming the shard, before its bytes are read."""
    folder = _copy(models, "bert", tmp_path / "bert")
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    save_file({k: sd[k] for k in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    outside = tmp_path / "elsewhere" / "secrets.txt"
    outside.parent.mkdir()
    outside.write_text("not weights")
    (folder / "model-00002-of-00002.safetensors").symlink_to(outside)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)},
            }
        )
    )
    with pytest.raises(
        ValueError,
        match=rf"{folder / 'model.safetensors.index.json'} names the shard "
        rf"'model-00002-of-00002.safetensors', a link out of the folder \(to "
        rf"{outside}\); refusing to read weights from outside {folder}",
    ):
        Engine(str(folder))


@pytest.mark.parametrize("damage", ["tokenizer.json list", "tokenizer.json empty", "vocab.txt empty"])
def test_a_broken_tokenizer_file_is_named(models, tmp_path, damage):
    folder = _copy(models, "bert", tmp_path / "bert")
    name, how = damage.split()
    f = folder / name
    if name == "vocab.txt":
        (folder / "tokenizer.json").unlink()  # the vocabulary is what transformers reads then
    f.write_text({"list": "[1, 2, 3]", "empty": ""}[how])
    match = {
        "tokenizer.json list": rf"{f} should hold a JSON object \(the fast tokenizer.*got a list; download or "
        r"save the tokenizer again",
        "tokenizer.json empty": rf"{f} is not valid JSON .*; it should hold a JSON object",
        "vocab.txt empty": rf"{f} is empty \(0 bytes\): the tokenizer has no vocabulary",
    }[damage]
    with pytest.raises(ValueError, match=match):
        Engine(str(folder))


def test_weights_under_another_name_are_not_guessed(models, tmp_path):
    folder = _copy(models, "bert", tmp_path / "bert")
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    with pytest.raises(
        FileNotFoundError,
        match=r"no weights in .*found weights.safetensors, which transformers does "
        r"not read either: rename the model's weights to model.safetensors",
    ):
        Engine(str(folder))


# ----------------------------------------------------------------------------------- 3. errors name the file
def test_a_pickle_that_holds_more_than_tensors_is_refused_naming_the_file(models, tmp_path):
    folder = _copy(models, "bert", tmp_path / "bert")
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({**sd, "saved_on": datetime.date(2024, 1, 1)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as e:
        Engine(str(folder))
    msg = str(e.value)
    assert f"{folder / 'pytorch_model.bin'} is refused for safety" in msg, msg
    assert "save_pretrained(out, safe_serialization=True)" in msg and "weights_only=False" not in msg.split(";")[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_broken_safetensors_file_is_named(models, tmp_path, damage):
    folder = _copy(models, "llama", tmp_path / "llama")
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07garbage" * 50, "empty": b""}[damage])
    with pytest.raises(ValueError, match=rf"{f} is not a valid safetensors file .*truncated or corrupt"):
        Engine(str(folder))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_broken_gguf_file_is_named(tmp_path, monkeypatch, damage):
    import gguf

    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).random((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = f.read_bytes()
    f.write_bytes(data[:-40] if damage == "truncated" else b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=rf"{f} is not a valid GGUF file .*truncated or corrupt"):
        Engine(str(f))


@pytest.mark.parametrize(
    "kind, key, shape, expected",
    [
        ("bert", "encoder.layer.1.intermediate.dense.weight", (48, 104), r"\(104, 48\)"),
        ("bert", "embeddings.LayerNorm.bias", (47,), r"\(48,\)"),
        ("llama", "model.layers.1.mlp.down_proj.weight", (96, 64), r"\(64, 96\)"),
        ("llama", "model.layers.0.self_attn.k_proj.weight", (64, 64), r"\(32, 64\)"),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_named(models, tmp_path, kind, key, shape, expected):
    folder = _copy(models, kind, tmp_path / kind)
    _edit_weights(folder, lambda sd: sd.update({key: torch.zeros(shape)}))
    said = re.escape(
        f"checkpoint tensor '{key.removeprefix('model.')}' in {folder / 'model.safetensors'} has "
        f"shape {tuple(shape)}, but config.json implies "
    )
    with pytest.raises(ValueError, match=said + expected):
        Engine(str(folder))


@pytest.mark.parametrize(
    "sbert, match",
    [
        (
            {"max_seq_length": "256"},
            (
                r"sentence_bert_config.json: max_seq_length must be a positive integer "
                r"\(tokens\) or null, got '256'"
            ),
        ),
        ({"max_seq_length": -1}, r"sentence_bert_config.json: max_seq_length must be a positive integer"),
        ([128], r"sentence_bert_config.json should hold a JSON object .*got a list"),
    ],
)
def test_bad_sentence_transformers_config_is_named(models, tmp_path, sbert, match):
    folder = _copy(models, "bert", tmp_path / "bert")
    (folder / "sentence_bert_config.json").write_text(json.dumps(sbert))
    with pytest.raises(ValueError, match=match):
        Engine(str(folder))


# ------------------------------------------------------------------------------------------------- adapters
def _adapter(folder: Path, config: dict | list | str | None = None, *, scale_b: float = 1.0, **tensors) -> str:
    """A hand-made PEFT LoRA folder for the tiny Llama: q_proj of layer 0 and down_proj of layer 1, rank 4."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for module, (out, inp) in {
        "model.layers.0.self_attn.q_proj": (64, 64),
        "model.layers.1.mlp.down_proj": (64, 96),
    }.items():
        sd[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, inp, generator=g) * 0.1
        sd[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.1 * scale_b
    sd.update(tensors)
    save_file(sd, str(folder / "adapter_model.safetensors"))
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    text = json.dumps(config if config is not None else base)
    if isinstance(config, dict):
        text = json.dumps({**base, **config}).replace('"__NaN__"', "NaN").replace('"__1e309__"', "1e309")
    (folder / "adapter_config.json").write_text(text)
    return str(folder)


@pytest.fixture(scope="module")
def live(models, tmp_path_factory):
    """A Llama engine with one good adapter merged, and its embeddings."""
    good = _adapter(tmp_path_factory.mktemp("good") / "lora")
    eng = Engine(str(models["llama"]), adapters=[good], pooling="mean")
    return eng, good, eng.embed(TEXTS)


@pytest.mark.parametrize(
    "config, match",
    [
        ([1, 2], r"adapter_config.json should hold a JSON object of LoRA settings .*got a list"),
        ("LORA", r"adapter_config.json should hold a JSON object of LoRA settings .*got a str"),
        ({"r": 0}, r"adapter_config.json: r \(the LoRA rank\) must be a positive integer, got 0"),
        ({"r": "4"}, r"adapter_config.json: r \(the LoRA rank\) must be a positive integer, got '4'"),
        ({"lora_alpha": None}, r"adapter_config.json: lora_alpha must be a finite number .*got None"),
        ({"lora_alpha": "8"}, r"adapter_config.json: lora_alpha must be a finite number .*got '8'"),
        ({"lora_alpha": "__NaN__"}, r"adapter_config.json: lora_alpha must be a finite number .*got nan"),
        ({"lora_alpha": "__1e309__"}, r"adapter_config.json: lora_alpha must be a finite number .*got inf"),
        ({"rank_pattern": ["q_proj"]}, r"adapter_config.json: rank_pattern must be an object mapping module names"),
        ({"rank_pattern": {"q_proj": 0}}, r"adapter_config.json: rank_pattern\['q_proj'\] must be a positive integer"),
        ({"alpha_pattern": {"q_proj": None}}, r"adapter_config.json: alpha_pattern\['q_proj'\] must be a finite"),
        (
            {"rank_pattern": {"layers.0.q_proj[": 4}},
            (
                r"adapter_config.json: rank_pattern has the key 'layers.0.q_proj\[', "
                r"which is not a valid regular expression \(unterminated "
                r"character set"
            ),
        ),
        (
            {"alpha_pattern": {"*_proj": 8}},
            (
                r"adapter_config.json: alpha_pattern has the key '\*_proj', which is not a "
                r"valid regular expression \(nothing to repeat.*re.escape"
            ),
        ),
    ],
)
def test_bad_adapter_configs_are_named_and_change_nothing(live, tmp_path, config, match):
    eng, _, before = live
    names = eng.adapter_names
    bad = _adapter(tmp_path / "bad", config)
    with pytest.raises(ValueError, match=match):
        read_adapter(bad)
    with pytest.raises(ValueError, match=match):
        eng.configure(adapters=[bad])
    assert eng.adapter_names == names
    np.testing.assert_array_equal(eng.embed(TEXTS), before)


def test_a_broken_adapter_weights_file_is_named(live, tmp_path):
    eng, _, before = live
    bad = Path(_adapter(tmp_path / "cut"))
    f = bad / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{f} is not a valid safetensors file .*truncated or corrupt"):
        eng.configure(adapters=[str(bad)])
    np.testing.assert_array_equal(eng.embed(TEXTS), before)


# ------------------------------------------------------------------------------------------- 4. non-finite
@pytest.mark.parametrize(
    "kind, key, value",
    [
        ("bert", "encoder.layer.1.output.dense.weight", float("nan")),
        ("bert", "embeddings.word_embeddings.weight", float("inf")),
        ("llama", "model.layers.0.self_attn.v_proj.weight", float("nan")),
        ("llama", "model.norm.weight", float("-inf")),
    ],
)
def test_non_finite_weights_are_named(models, tmp_path, kind, key, value):
    folder = _copy(models, kind, tmp_path / kind)

    def poison(sd):
        sd[key] = sd[key].clone()
        sd[key].view(-1)[7] = value

    _edit_weights(folder, poison)
    with pytest.raises(
        ValueError,
        match=rf"tensor '{key}' of {folder / 'model.safetensors'} holds 1 non-finite "
        rf"value\(s\) \(NaN / Inf; the first, {value}, at index",
    ):
        Engine(str(folder))


def test_non_finite_adapter_weights_are_refused_and_change_nothing(live, tmp_path):
    eng, _, before = live
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    b = torch.randn(64, 4)
    b[3, 1] = float("nan")
    bad = _adapter(tmp_path / "nan", **{key: b})
    with pytest.raises(ValueError, match=rf"tensor '{key}' of {bad}/adapter_model.safetensors holds 1 non-finite"):
        eng.configure(adapters=[bad])
    np.testing.assert_array_equal(eng.embed(TEXTS), before)


def test_a_merge_that_overflows_is_refused_and_changes_nothing(live, models, tmp_path):
    """Finite LoRA weights whose product overflows float32 would make every embedding NaN."""
    eng, good, before = live
    bad = _adapter(tmp_path / "huge", {"lora_alpha": 1e30}, scale_b=1e20)  # all finite; B @ A * 2.5e29 is not
    with pytest.raises(
        ValueError,
        match=r"the merged weight 'layers.0.qkv.weight' \(LoRA modules "
        r"'model.layers.0.self_attn.q_proj' of .*huge'\) holds \d+ non-finite",
    ):
        eng.configure(adapters=[good, bad])
    np.testing.assert_array_equal(eng.embed(TEXTS), before)
    with pytest.raises(ValueError, match="non-finite"):
        Engine(str(models["llama"]), adapters=[bad])
