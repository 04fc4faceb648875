"""LLM2Vec the way its users run it: the adapters ``lab.adapt`` writes load in peft over the bare model (llm2vec's
scope) for every decoder family, ``llm2vec_config.json`` sets knob defaults, and the published checkpoint layouts
(a ``-mntp`` folder: base config + tokenizer + MNTP adapter, weights in the base its ``adapter_config.json``
names; a ``-supervised`` / ``-simcse`` adapter stacked on it) load offline without running their custom code.

The replicas use the file names and config keys of the McGill-NLP repositories (``LLM2Vec-Meta-Llama-3-8B-Instruct-
mntp``: ``config.json`` with an ``auto_map`` to ``modeling_llama_encoder.LlamaEncoderModel``,
``modeling_llama_encoder.py``, ``attn_mask_utils.py``, tokenizer files, ``adapter_config.json`` whose
``base_model_name_or_path`` is the hub id of the base, ``adapter_model.safetensors``; ``-mntp-supervised``:
``adapter_config.json`` naming the ``-mntp`` repository, ``adapter_model.safetensors``, ``README.md``). The
reference is peft itself over ``AutoModel`` (llm2vec's wrapping), bidirectional, mean pooling, float32.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cosine_rows
from safetensors import safe_open
from tiny_models import KINDS, tiny_llama

from lab import Engine as _Engine
from lab.adapt import mntp, simcse
from lab.adapt.peft_lora import LoraSpec
from lab.adapt.run_files import LLM2VEC_CONFIG
from lab.adapt.train import set_bidirectional

COS_MIN = 0.99999
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "What is the capital of France?",
    "Rotary position embeddings rotate queries and keys by an angle.",
    "Paris",
]
TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "A packed batch holds many sequences.",
    "Rotary embeddings rotate queries and keys.",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Embeddings map text to vectors.",
]
SMALL = LoraSpec(r=2, alpha=4.0, dropout=0.0)


def Engine(*args, **kw) -> _Engine:
    return _Engine(*args, **{"device": "cpu", "normalize": False, **kw})


def peft_reference(base, adapters, texts=TEXTS, *, bidirectional: bool = True) -> np.ndarray:
    """llm2vec's model: ``AutoModel`` (the bare model), each adapter loaded by peft and merged in turn, attention
    made bidirectional; mean of the last hidden states, one text at a time."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(base, dtype=torch.float32).eval()
    for a in adapters:
        model = PeftModel.from_pretrained(model, str(a)).merge_and_unload()
    set_bidirectional(model, bidirectional)
    tok = AutoTokenizer.from_pretrained(base)
    with torch.no_grad():
        return np.stack([model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0).numpy() for t in texts])


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(cosine_rows(a, b).min())


def assert_peft_loads_every_key(base, folder) -> None:
    """peft over the bare ``AutoModel`` finds every tensor of the folder: no missing-keys warning, and the loaded
    LoRA weights are the file's (a missing key would leave ``lora_B`` at its zero init)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(AutoModel.from_pretrained(base, dtype=torch.float32), str(folder))
    assert not [w for w in caught if "missing adapter keys" in str(w.message).lower()], [
        str(w.message) for w in caught
    ]
    loaded = get_peft_model_state_dict(pm)
    with safe_open(str(Path(folder) / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert set(loaded) == keys, (sorted(set(loaded) ^ keys))[:4]
        for k in keys:
            assert torch.equal(loaded[k].float(), f.get_tensor(k).float()), k
    assert any(k.endswith("lora_B.weight") and loaded[k].abs().sum() > 0 for k in loaded)


def bare_adapter(base, out, *, seed: int, base_name: str | None = None, **config) -> str:
    """A random (non-zero ``B``) LoRA made by peft on ``AutoModel.from_pretrained(base)``: keys
    ``base_model.model.layers.N...``, as llm2vec trains and saves them. ``base_name``: the
    ``base_model_name_or_path`` written; ``config``: more ``adapter_config.json`` keys."""
    import peft
    from transformers import AutoModel

    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(model, lora).save_pretrained(out)
    cfg_file = Path(out) / "adapter_config.json"
    cfg = {**json.loads(cfg_file.read_text()), **config}
    if base_name is not None:
        cfg["base_model_name_or_path"] = base_name
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return str(out)


# ------------------------------------------------------------------------------------- lab.adapt's folders in peft
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per decoder family: (base, MNTP folder, SimCSE-on-MNTP folder), two training steps each at a large learning rate
    (real deltas)."""
    root = tmp_path_factory.mktemp("llm2vec-adapt")
    out = {}
    for kind in KINDS:
        base = tiny_llama(root, kind)
        kw = {"steps": 2, "batch_size": 3, "lr": 0.05, "lora": SMALL, "show_progress": False, "dtype": "float32"}
        m = mntp(base, TRAIN, root / f"{kind}-mntp", **kw).path
        s = simcse(base, TRAIN, root / f"{kind}-simcse", adapters=[m], **kw).path
        out[kind] = (base, m, s)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_adapt_folders_load_in_peft_over_the_bare_model_and_equal_the_engine(trained, kind):
    base, m, s = trained[kind]
    for folder in (m, s):
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
        assert keys and all(k.startswith("base_model.model.layers.") for k in keys), keys[:2]
        assert json.loads((folder / "llm2vec_config.json").read_text()) == LLM2VEC_CONFIG
        assert_peft_loads_every_key(base, folder)
    eng = Engine(str(base), adapters=[str(m), str(s)], bidirectional=True, pooling="mean")
    want = peft_reference(base, [m, s])
    cos = min_cos(eng.embed(TEXTS), want)
    print(f"{kind}: lab.adapt MNTP + SimCSE, Engine vs peft over AutoModel: min cos {cos:.8f}")
    assert cos >= COS_MIN
    assert min_cos(Engine(str(base), bidirectional=True, pooling="mean").embed(TEXTS), want) < 0.999  # real deltas


# -------------------------------------------------------------------------------- llm2vec_config.json: knob defaults
def with_llm2vec_config(folder: Path, out: Path, **cfg) -> Path:
    shutil.copytree(folder, out)
    (out / "llm2vec_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llm2vec-cfg"), "llama")


@pytest.mark.parametrize(
    "mode,pooling,append_eos",
    [
        ("mean", "mean", False),
        ("weighted_mean", "weightedmean", False),
        ("eos_token", "eos_token", False),
        ("last_token", "lasttoken", False),
        ("bos_token", "cls", False),
    ],
)
def test_llm2vec_pooling_names_map_to_ours(base, tmp_path, mode, pooling, append_eos):
    folder = with_llm2vec_config(base, tmp_path / mode, pooling_mode=mode)
    eng = Engine(str(folder))
    assert (eng.resolved["pooling"], eng.resolved["append_eos"]) == (pooling, append_eos)
    assert eng.resolved["instruction_pooling"] == "llm2vec"  # the folder asks for llm2vec's conventions
    assert eng.resolved["causal"] is False  # llm2vec enables bidirectional attention unless told not to
    np.testing.assert_array_equal(
        eng.embed(TEXTS),
        Engine(
            str(base), pooling=pooling, append_eos=append_eos, instruction_pooling="llm2vec", bidirectional=True
        ).embed(TEXTS),
    )


def test_llm2vec_config_sets_defaults_and_explicit_knobs_win(base, tmp_path):
    folder = with_llm2vec_config(
        base, tmp_path / "cfg", pooling_mode="weighted_mean", max_length=6, doc_max_length=400, skip_instruction=False
    )
    eng = Engine(str(folder), instruction="Retrieve: ")
    r = eng.resolved
    assert (r["pooling"], r["max_length"], r["include_instruction"]) == ("weightedmean", 6, True)
    assert eng.knobs["pooling"] is None and eng.knobs["max_length"] is None  # defaults, not knob values
    out = eng.embed(TEXTS)
    assert eng.stats.truncated > 0  # max_length=6 cuts the long texts
    same = Engine(
        str(base),
        pooling="weightedmean",
        max_length=6,
        include_instruction=True,
        instruction="Retrieve: ",
        bidirectional=True,
        instruction_pooling="llm2vec",
    )
    np.testing.assert_array_equal(out, same.embed(TEXTS))
    eng.configure(pooling="mean", max_length=64, include_instruction=False)  # explicit knobs win
    r = eng.resolved
    assert (r["pooling"], r["max_length"], r["include_instruction"]) == ("mean", 64, False)
    eng.configure(pooling=None, max_length=None, include_instruction=None)  # None: back to the folder's
    assert (eng.resolved["pooling"], eng.resolved["max_length"]) == ("weightedmean", 6)
    # a max_length past the model's positions is capped there, as the other defaults are
    big = with_llm2vec_config(base, tmp_path / "big", max_length=100_000)
    assert Engine(str(big)).resolved["max_length"] == 256


def test_adapter_llm2vec_config_overrides_the_models_and_follows_the_stack(base, tmp_path):
    folder = with_llm2vec_config(base, tmp_path / "model", pooling_mode="weighted_mean", max_length=40)
    plain = bare_adapter(base, tmp_path / "plain", seed=1)
    tuned = bare_adapter(base, tmp_path / "tuned", seed=2)
    (Path(tuned) / "llm2vec_config.json").write_text(
        json.dumps({"pooling_mode": "mean", "max_length": 20, "skip_instruction": True})
    )
    """llm2vec reads llm2vec_config.json from peft_model_name_or_path (our last adapter) when there is one, else from
    the base folder, and from nowhere else: an adapter without the file brings llm2vec's class defaults."""
    eng = Engine(str(folder))
    assert (eng.resolved["pooling"], eng.resolved["max_length"]) == ("weightedmean", 40)
    assert eng.resolved.sources["pooling"] == f"llm2vec_config.json in {folder}"
    eng.configure(adapters=[plain])  # no llm2vec_config.json in the adapter: llm2vec's defaults, not the model's
    assert (eng.resolved["pooling"], eng.resolved["max_length"]) == ("mean", 256)  # 512, capped at the positions
    assert eng.resolved.sources["pooling"] == eng.resolved.sources["max_length"] == "llm2vec default"
    eng.configure(adapters=[plain, tuned])  # the last adapter's
    assert (eng.resolved["pooling"], eng.resolved["max_length"]) == ("mean", 20)
    assert {
        k: eng.resolved.defaults[k] for k in ("pooling", "max_length", "include_instruction", "doc_max_length")
    } == {"pooling": "mean", "max_length": 20, "include_instruction": False, "doc_max_length": 400}
    eng.configure(adapters=[tuned, plain])  # the last adapter has none: llm2vec's defaults
    assert eng.resolved.sources["pooling"] == "llm2vec default"
    eng.configure(adapters=[])
    assert (eng.resolved["pooling"], eng.resolved["max_length"]) == ("weightedmean", 40)


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"pooling_mode": "latent_attention"}, r"llm2vec_config.json: pooling_mode 'latent_attention'.*valid: mean"),
        ({"max_length": 0}, r"llm2vec_config.json: max_length must be a positive integer"),
        ({"max_length": "512"}, r"llm2vec_config.json: max_length must be a positive integer"),
        ({"skip_instruction": "yes"}, r"llm2vec_config.json: skip_instruction must be true or false"),
        ([1, 2], r"llm2vec_config.json should hold a JSON object"),
    ],
)
def test_bad_llm2vec_config_is_named(base, tmp_path, cfg, match):
    folder = with_llm2vec_config(base, tmp_path / "bad", **({} if isinstance(cfg, list) else cfg))
    if isinstance(cfg, list):
        (folder / "llm2vec_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        Engine(str(folder))


def test_unknown_llm2vec_config_keys_warn(base, tmp_path):
    folder = with_llm2vec_config(base, tmp_path / "extra", pooling_mode="mean", temperature=0.05)
    with pytest.warns(UserWarning, match="temperature.*ignored"):
        eng = Engine(str(folder))
    assert eng.resolved["pooling"] == "mean"


# ------------------------------------------------------------------------------------ published layouts, offline
BASE_ID = "meta-llama/Meta-Llama-3-8B-Instruct"
MNTP_ID = "McGill-NLP/LLM2Vec-Meta-Llama-3-8B-Instruct-mntp"
CUSTOM_CODE = """from pathlib import Path
Path(__file__).with_name("EXECUTED").write_text("custom code ran")
raise RuntimeError("custom model code must never be executed")
"""


def published_layout(root: Path, base: Path, *, base_ref: str = BASE_ID) -> tuple[Path, Path, Path]:
    """``root/meta-llama/Meta-Llama-3-8B-Instruct`` (the base), ``root/McGill-NLP/LLM2Vec-...-mntp`` (config.json
    with an auto_map, custom .py files, tokenizer, MNTP adapter naming ``base_ref``) and ``...-mntp-supervised``
    (an adapter naming the ``-mntp`` hub id), as ``hf download --local-dir`` lays them out. Adapters are made by peft
    on ``AutoModel`` (llm2vec's keys)."""
    base_dir = root / BASE_ID
    shutil.copytree(base, base_dir)
    mntp_dir = root / MNTP_ID
    mntp_dir.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    config["_name_or_path"] = BASE_ID
    config["auto_map"] = {"AutoModel": "modeling_llama_encoder.LlamaEncoderModel"}
    (mntp_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens_map")):
            shutil.copy(f, mntp_dir / f.name)
    for name in ("modeling_llama_encoder.py", "attn_mask_utils.py"):
        (mntp_dir / name).write_text(CUSTOM_CODE)
    bare_adapter(
        base,
        mntp_dir,
        seed=3,
        base_name=base_ref,
        auto_mapping={"base_model_class": "LlamaBiModel", "parent_library": "llm2vec.models.bidirectional_llama"},
    )
    sup_dir = root / (MNTP_ID + "-supervised")
    bare_adapter(base, sup_dir, seed=4, base_name=MNTP_ID)
    (sup_dir / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    return base_dir, mntp_dir, sup_dir


@pytest.fixture(scope="module")
def published(tmp_path_factory, base):
    root = tmp_path_factory.mktemp("published")
    return (root, *published_layout(root, base, base_ref="../../" + BASE_ID))


def test_mntp_folder_with_a_stacked_adapter_equals_base_plus_both(published, monkeypatch):
    """The weights: the -mntp folder with a stacked adapter is its base plus both adapters (the exact rule here:
    under llm2vec's, the -mntp folder's config brings its base's chat template, ``test_chat_template_...``)."""
    root, base_dir, mntp_dir, sup_dir = published
    eng = Engine(
        str(mntp_dir), adapters=[str(sup_dir)], bidirectional=True, pooling="mean", instruction_pooling="exact"
    )
    assert Path(eng.model_path) == base_dir.resolve()
    assert eng.knobs["adapters"] == (str(mntp_dir), str(sup_dir))
    out = eng.embed(TEXTS)
    np.testing.assert_array_equal(
        out,
        Engine(
            str(base_dir),
            adapters=[str(mntp_dir), str(sup_dir)],
            bidirectional=True,
            pooling="mean",
            instruction_pooling="exact",
        ).embed(TEXTS),
    )
    cos = min_cos(out, peft_reference(base_dir, [mntp_dir, sup_dir]))
    print(f"published -mntp + -supervised layout vs peft: min cos {cos:.8f}")
    assert cos >= COS_MIN
    assert not list(root.rglob("EXECUTED"))  # the folder's modeling code never ran
    # the supervised folder alone: its base is the -mntp hub id, found from the download folder (current directory)
    monkeypatch.chdir(root)
    alone = Engine(str(sup_dir), bidirectional=True, pooling="mean", instruction_pooling="exact")
    assert alone.knobs["adapters"] == (str(root / MNTP_ID), str(sup_dir))
    np.testing.assert_array_equal(alone.embed(TEXTS), out)


def test_base_found_by_absolute_path_and_in_the_hub_cache(base, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    root = tmp_path / "abs"
    base_dir, mntp_dir, _ = published_layout(root, base, base_ref="placeholder")
    cfg = json.loads((mntp_dir / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base_dir)
    (mntp_dir / "adapter_config.json").write_text(json.dumps(cfg))
    want = Engine(str(base_dir), adapters=[str(mntp_dir)], pooling="mean", instruction_pooling="exact").embed(TEXTS)
    np.testing.assert_array_equal(
        Engine(str(mntp_dir), pooling="mean", instruction_pooling="exact").embed(TEXTS), want
    )
    # the hub id, resolved from a Hugging Face cache snapshot (offline: nothing is downloaded)
    cache = tmp_path / "hub-cache"
    snap = cache / ("models--" + BASE_ID.replace("/", "--")) / "snapshots" / "0123abcd"
    shutil.copytree(base, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0123abcd")
    cfg["base_model_name_or_path"] = BASE_ID
    (mntp_dir / "adapter_config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    eng = Engine(str(mntp_dir), pooling="mean", instruction_pooling="exact")
    assert Path(eng.model_path) == snap.resolve()
    np.testing.assert_array_equal(eng.embed(TEXTS), want)


def test_missing_base_names_it_and_the_fix(base, tmp_path, monkeypatch):
    root = tmp_path / "missing"
    base_dir, mntp_dir, sup_dir = published_layout(root, base)
    shutil.rmtree(base_dir)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=(
            r"its base 'meta-llama/Meta-Llama-3-8B-Instruct' \(base_model_name_or_path "
            r"in .*adapter_config.json\) is not a local folder.*hub id.*Download the "
            r"base model.*base_model_name_or_path"
        ),
    ):
        Engine(str(mntp_dir), adapters=[str(sup_dir)])
    assert not list(root.rglob("EXECUTED"))


def test_mntp_config_of_another_family_is_refused(base, tmp_path):
    root = tmp_path / "family"
    _, mntp_dir, _ = published_layout(root, base, base_ref="../../" + BASE_ID)
    cfg = json.loads((mntp_dir / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (mntp_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"describes a 'mistral' model.*is a 'llama' model"):
        Engine(str(mntp_dir))


def test_parity_script_writes_a_transformers4_copy_the_engine_reads_alike(base, tmp_path):
    """``evals/llm2vec_parity.py``'s base folder for the llm2vec venv (``rope_theta`` in config.json, BPE merges as
    strings, weights linked) is the same model and tokenizer to the Engine."""
    from evals.llm2vec_parity_folders import transformers4_copy

    copy = transformers4_copy(base, tmp_path / "t4")
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and "rope_parameters" not in cfg
    merges = json.loads((copy / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    assert (copy / "model.safetensors").is_symlink()
    np.testing.assert_array_equal(
        Engine(str(copy), pooling="mean").embed(TEXTS), Engine(str(base), pooling="mean").embed(TEXTS)
    )
