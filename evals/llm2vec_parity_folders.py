"""The folders ``evals/llm2vec_parity.py`` compares on, laid out as LLM2Vec's published checkpoints are: the base as
transformers 4.44 reads it (``transformers4_copy``), the ``-mntp`` folder (``mntp_folder``), the study's adapters in
either key scope (``causal_scoped``), all of them for the settings rows (``build_folders``), and a plain row's
published layout, by local path or from a hub cache (``published_folders``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from evals.llm2vec_parity_variants import Variant

STUDY = Path(__file__).resolve().parent / "results" / "llm2vec"


def transformers4_copy(src: Path, out: Path) -> Path:
    """``src`` (a transformers-5 Llama folder) as transformers 4.44 reads it: ``rope_theta`` (and
    ``torch_dtype``) in ``config.json``; ``tokenizer.json`` with its BPE merges as ``"a b"`` strings (tokenizers
    0.19 cannot parse pairs); a ``PreTrainedTokenizerFast`` ``tokenizer_config.json`` whose inputs are ids and
    attention mask only. The weights are linked."""
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{src}: rope_parameters {rope} has no transformers-4 equivalent this script writes")
    cfg["torch_dtype"] = cfg.get("dtype", "float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = json.loads((src / "tokenizer.json").read_text())
    merges = tok.get("model", {}).get("merges") or []
    if merges and isinstance(merges[0], list):
        if any(" " in a or " " in b for a, b in merges):
            raise ValueError(f"{src / 'tokenizer.json'}: a merge holds a space; it cannot be written as 'a b'")
        tok["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    keep = {k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length") if k in tcfg}
    keep.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        }
    )  # no token_type_ids: LlamaModel refuses them
    (out / "tokenizer_config.json").write_text(json.dumps(keep, indent=2))
    (out / "model.safetensors").symlink_to((src / "model.safetensors").resolve())
    return out


def mntp_folder(base: Path, adapter: Path, out: Path) -> Path:
    """LLM2Vec's published ``-mntp`` layout: the base's ``config.json`` and tokenizer files beside the adapter,
    ``base_model_name_or_path`` naming the base folder (absolute: transformers 4.44 resolves it from the current
    directory)."""
    shutil.copytree(adapter, out)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, out / f)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base.resolve())
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def causal_scoped(src: Path, dst: Path) -> Path:
    """A copy of the adapter folder ``src`` at ``dst`` whose keys are in the ``*ForCausalLM`` scope
    (``base_model.model.layers...`` -> ``base_model.model.model.layers...``; keys already in it kept), the tensors
    and the other files unchanged: how an adapter trained on a causal-LM class is saved."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    bare = "base_model.model."
    sd = load_file(weights)
    moved = {(k if k.startswith(bare + "model.") else bare + "model." + k[len(bare) :]): v for k, v in sd.items()}
    save_file(moved, weights, metadata={"format": "pt"})
    return dst


def build_folders(work: Path) -> dict[str, Path]:
    """The base, and per scope the -mntp folder and the SimCSE adapter: ``{"base", "mntp:bare", "simcse:bare",
    "mntp:causal", "simcse:causal"}``."""
    from lab.adapt import rescope
    from lab.models.gguf import smollm2_path

    base = transformers4_copy(Path(smollm2_path()), work / "SmolLM2-135M-Instruct")
    folders = {"base": base}
    for scope, scoped in (("bare", rescope), ("causal", causal_scoped)):
        m, s = (scoped(STUDY / name, work / f"{scope}-scope" / name) for name in ("mntp", "mntp_simcse"))
        folders[f"mntp:{scope}"] = mntp_folder(base, m, work / scope / "SmolLM2-llm2vec-mntp")
        dst = work / scope / "SmolLM2-llm2vec-mntp-simcse"
        shutil.copytree(s, dst)
        folders[f"simcse:{scope}"] = dst
    return folders


def published_folders(v: Variant, folders: dict[str, Path], work: Path, hub_cache: Path) -> tuple[str, str | None]:
    """The folders of a ``plain`` row as LLM2Vec publishes them, and the names both sides are given: ``(mntp,
    supervised or None)``, local paths, or hub ids written into ``hub_cache`` (``tests/hub_cache.py``).

    The -mntp folder: the base's ``config.json`` with ``_name_or_path`` = ``v.name_or_path`` and an ``auto_map`` to
    llm2vec's ``modeling_llama_encoder.LlamaEncoderModel`` (the code file itself left out: neither side runs it), the
    tokenizer files and the MNTP adapter, whose ``base_model_name_or_path`` is the base folder (or the base's hub id);
    the supervised folder: the SimCSE adapter, its ``base_model_name_or_path`` the -mntp folder (or id). Neither has
    ``llm2vec_config.json`` unless ``v.mntp_config`` / ``v.peft_config`` writes one."""
    from tests.hub_cache import write_hub_cache

    tag = "".join(c if c.isalnum() else "_" for c in v.name)
    base = folders["base"]
    mntp, sup = work / "plain" / tag / "mntp", work / "plain" / tag / "supervised"
    mntp_name, base_name = v.hub if v.hub else (str(mntp), str(base.resolve()))
    sup_name = f"{mntp_name}-supervised" if v.hub else str(sup)
    for src, dst, cfg, parent in (
        (folders["mntp:bare"], mntp, v.mntp_config, base_name),
        (folders["simcse:bare"], sup, v.peft_config, mntp_name),
    ):
        shutil.copytree(
            src,
            dst,
            ignore=shutil.ignore_patterns(
                "llm2vec_config.json", "config.json", "tokenizer*", "*.png", "*.csv", "train_config.json"
            ),
        )
        adapter = json.loads((dst / "adapter_config.json").read_text())
        adapter["base_model_name_or_path"] = parent
        (dst / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
        if cfg is not None:
            (dst / "llm2vec_config.json").write_text(json.dumps(cfg, indent=4))
    config = json.loads((base / "config.json").read_text())
    config.update(
        {"_name_or_path": v.name_or_path, "auto_map": {"AutoModel": "modeling_llama_encoder.LlamaEncoderModel"}}
    )
    (mntp / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, mntp / f)
    if not v.hub:
        return str(mntp), str(sup) if v.peft else None
    repos = [(mntp_name, mntp), (sup_name, sup)]
    if not (hub_cache / f"models--{base_name.replace('/', '--')}").is_dir():  # one base id, rows to share it
        repos.append((base_name, base))
    for repo, folder in repos:  # a fixed commit per repo
        write_hub_cache(hub_cache, repo, folder, commit=hashlib.sha1(repo.encode()).hexdigest())
    return mntp_name, sup_name if v.peft else None
