"""The Engine against the official llm2vec 0.2.3, the way llm2vec's users run it, on held-out STS sentences.

llm2vec runs in its own virtual environment (``evals/llm2vec_ref``: transformers 4.44.2, peft 0.21.2, torch 2.13.0
CPU; made on first use, see that folder's README) through ``evals/llm2vec_ref/run_llm2vec.py`` in a subprocess; the
Engine runs here. Both read the same folders, laid out as LLM2Vec's published checkpoints are:

- the base: a copy of SmolLM2-135M-Instruct that transformers 4.44 reads (``rope_theta`` in ``config.json``,
  tokenizer files in the 4.x format; the weights linked);
- an ``-mntp`` folder: the base's ``config.json`` and tokenizer beside the MNTP adapter, whose
  ``base_model_name_or_path`` names the base folder (llm2vec: ``LLM2Vec.from_pretrained(mntp_folder, ...)``; the
  Engine: ``Engine(mntp_folder, ...)``);
- a SimCSE adapter stacked on it (llm2vec: ``peft_model_name_or_path``; the Engine: ``adapters=[...]``).

The adapters are the study's committed ones (``evals/results/llm2vec/{mntp,mntp_simcse}``, in the bare-model
scope ``lab.adapt`` writes), passed through ``lab.adapt.rescope`` into a temporary folder (a no-op for folders
already in that scope); the ``control`` variant loads copies whose keys are put in the ``*ForCausalLM`` scope
(``causal_scoped``: ``base_model.model.model.layers...``, tensors unchanged), which shows what llm2vec does with
adapters saved that way (peft warns "Found missing adapter keys" and leaves every ``lora_B`` at zero), while the
Engine reads both scopes alike. Every variant: mean pooling, max_length 512,
instructions not pooled (llm2vec's ``skip_instruction``), float32, no normalization; inputs are llm2vec's
``[[instruction, text]]`` pairs (``""`` without an instruction). A variant is a ``Variant`` row (its folders, its
attention, an instruction, and extra Engine knobs), so rows with an instruction are one more entry in ``VARIANTS``.

Writes ``evals/results/llm2vec_parity/llm2vec_parity_<machine_slug>.csv`` (one row per variant: min and median
cosine between the two embeddings of each sentence, llm2vec's missing adapter keys, timings, versions) and a
short ``.md`` beside it.

    python evals/llm2vec_parity.py                       # 300 sentences, the reference venv made if missing
    python evals/llm2vec_parity.py --venv /path/to/venv --sentences 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.criteria import row_cosines  # after the path set-up: this runs as a script
from evals.data_io import DATA, read_jsonl, spread
from lab import env

REF = ROOT / "evals" / "llm2vec_ref"
OUT = ROOT / "evals" / "results" / "llm2vec_parity"
STUDY = ROOT / "evals" / "results" / "llm2vec"
DEFAULT_VENV = env.path("LAB_LLM2VEC_VENV", Path.home() / ".cache" / "prefill-lab" / "venvs" / "llm2vec")
STS_FILES = ("sts12/test.jsonl.gz", "sts14/test.jsonl.gz", "sts16/test.jsonl.gz")  # held out of the study's training
# llm2vec's encoder settings and the Engine knobs that mean the same
LLM2VEC_ENCODER = {"pooling_mode": "mean", "max_length": 512, "skip_instruction": True}
ENGINE_KNOBS = {"pooling": "mean", "max_length": 512, "include_instruction": False, "normalize": False,
                "dtype": "float32", "device": "cpu"}


@dataclass(frozen=True)
class Variant:
    """One comparison. ``model``: ``base`` or ``mntp`` (the -mntp folder); ``peft``: ``None`` or ``simcse`` (the
    adapter stacked on it); ``scope``: ``bare`` (rescoped adapters) or ``causal`` (``causal_scoped`` copies);
    ``instruction``: the instruction of every input (llm2vec's ``[instruction, text]``; the Engine's
    ``instruction=``); ``knobs``: more Engine knobs for this row."""

    name: str
    model: str = "base"
    peft: str | None = None
    bidirectional: bool = True
    scope: str = "bare"
    instruction: str = ""
    knobs: dict = field(default_factory=dict)


VARIANTS = [
    Variant("causal base", bidirectional=False),
    Variant("bidirectional base"),
    Variant("bidirectional + MNTP", model="mntp"),
    Variant("bidirectional + MNTP + SimCSE", model="mntp", peft="simcse"),
    Variant("control: MNTP + SimCSE in the ForCausalLM scope", model="mntp", peft="simcse", scope="causal"),
    # llm2vec's instruction handling: its embed mask is the Engine's instruction_pooling="llm2vec"
    Variant("bidirectional + MNTP + SimCSE, instruction", model="mntp", peft="simcse",
            instruction="Retrieve semantically similar text: ", knobs={"instruction_pooling": "llm2vec"}),
]


# ----------------------------------------------------------------------------------------- reference venv
def ensure_venv(venv: Path) -> Path:
    """The reference environment's python, made from ``evals/llm2vec_ref/requirements.txt`` when missing: torch
    first and alone (its pinned line), then the rest."""
    py = venv / "bin" / "python"
    if py.exists():
        return py
    reqs = (REF / "requirements.txt").read_text().splitlines()
    torch_pin = next(line.strip() for line in reqs if line.strip().startswith("torch=="))
    python = shutil.which("python3.11") or sys.executable
    print(f"making the llm2vec reference environment in {venv} (once)", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", torch_pin], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(REF / "requirements.txt")], check=True)
    return py


# ------------------------------------------------------------------------------------------------- folders
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
    keep.update({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                 "model_input_names": ["input_ids", "attention_mask"]})  # no token_type_ids: LlamaModel refuses them
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
    moved = {(k if k.startswith(bare + "model.") else bare + "model." + k[len(bare):]): v for k, v in sd.items()}
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


# ------------------------------------------------------------------------------------------------- running
def sentences(n: int) -> list[str]:
    """``n`` distinct sentences spread evenly over STS12, STS14 and STS16 test (never trained on by the study)."""
    seen: dict[str, None] = {}
    for f in STS_FILES:
        for r in read_jsonl(DATA / f):
            seen.setdefault(r["sentence1"], None)
            seen.setdefault(r["sentence2"], None)
    pool = list(seen)
    return [pool[i] for i in spread(len(pool), n)]


def run_llm2vec(py: Path, v: Variant, folders: dict[str, Path], texts: list[str], work: Path):
    import numpy as np

    tag = "".join(c if c.isalnum() else "_" for c in v.name)
    job = {"model": str(folders["base"] if v.model == "base" else folders[f"mntp:{v.scope}"]),
           "peft": str(folders[f"simcse:{v.scope}"]) if v.peft else None, "bidirectional": v.bidirectional,
           "encoder": LLM2VEC_ENCODER, "inputs": [[v.instruction, t] for t in texts],
           "out": str(work / f"{tag}.npy"), "report": str(work / f"{tag}.json")}
    (work / f"{tag}.job.json").write_text(json.dumps(job))
    env = {k: val for k, val in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(py), str(REF / "run_llm2vec.py"), str(work / f"{tag}.job.json")], cwd=work, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llm2vec failed on {v.name!r}:\n{done.stderr[-4000:]}")
    return np.load(job["out"]), json.loads(Path(job["report"]).read_text())


def run_engine(v: Variant, folders: dict[str, Path], texts: list[str]):
    from lab import Engine

    model = folders["base"] if v.model == "base" else folders[f"mntp:{v.scope}"]
    adapters = [str(folders[f"simcse:{v.scope}"])] if v.peft else []
    t0 = time.perf_counter()
    eng = Engine(str(model), adapters=adapters, bidirectional=v.bidirectional, **{**ENGINE_KNOBS, **v.knobs})
    out = eng.embed(texts, instruction=v.instruction or None)
    return out, time.perf_counter() - t0, eng


def main(argv: list[str] | None = None) -> int:
    import pandas as pd
    import torch

    from lab.ops.probes import machine_slug

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the llm2vec reference environment")
    ap.add_argument("--sentences", type=int, default=300)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--variants", nargs="+", default=None, help="run only these variants (names as in VARIANTS)")
    args = ap.parse_args(argv)
    chosen = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
    if not chosen:
        raise SystemExit(f"no variant named {args.variants}; valid: {[v.name for v in VARIANTS]}")
    py = ensure_venv(args.venv)
    texts = sentences(args.sentences)
    rows = []
    with tempfile.TemporaryDirectory(prefix="llm2vec-parity-") as tmp:
        work = Path(tmp)
        folders = build_folders(work)
        for v in chosen:
            theirs, report = run_llm2vec(py, v, folders, texts, work)
            ours, engine_s, eng = run_engine(v, folders, texts)
            cos = row_cosines(ours, theirs).tolist()
            rows.append({
                "variant": v.name, "model": "-mntp folder" if v.model == "mntp" else "base",
                "adapters": "+".join(Path(a).name for a in eng.knobs["adapters"]) or "none",
                "key_scope": v.scope if v.model == "mntp" else "", "bidirectional": v.bidirectional,
                "instruction": v.instruction, "sentences": len(texts), "min_cos": min(cos),
                "median_cos": statistics.median(cos), "missing_adapter_keys": report["missing_adapter_keys"],
                "llm2vec_seconds": round(report["load_seconds"] + report["encode_seconds"], 2),
                "engine_seconds": round(engine_s, 2), "pooling": eng.resolved["pooling"],
                "max_length": eng.resolved["max_length"], **{f"ref_{k}": val for k, val in report["versions"].items()},
                "torch": torch.__version__,
            })
            print(f"{v.name}: min cos {min(cos):.6f}, median {statistics.median(cos):.6f}, "
                  f"missing adapter keys {report['missing_adapter_keys']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = machine_slug()
    table = pd.DataFrame(rows)
    csv = args.out / f"llm2vec_parity_{slug}.csv"
    table.to_csv(csv, index=False)
    from evals.results_index import write_meta

    write_meta(csv)  # the date and command for evals/results/README.md
    write_md(table, args.out / f"llm2vec_parity_{slug}.md", slug)
    print(f"wrote {csv}")
    return 0


def write_md(table, path: Path, slug: str) -> None:
    versions = table.iloc[0]
    intro = (f"{int(versions['sentences'])} distinct sentences of STS12/14/16 test; cosine between llm2vec's and the "
             "Engine's embedding of each. Adapters: the study's MNTP and SimCSE (`evals/results/llm2vec`), rescoped "
             "with `lab.adapt.rescope`; the -mntp folder is the base's config and tokenizer beside the MNTP adapter, "
             "loaded by llm2vec as `LLM2Vec.from_pretrained(mntp, peft_model_name_or_path=simcse)` and by the Engine "
             "as `Engine(mntp, adapters=[simcse])`. The control row loads copies with the keys in the ForCausalLM "
             "scope (`causal_scoped`, tensors unchanged): llm2vec's peft misses their keys and runs without them.")
    reproduce = (f"Reproduce: `python evals/llm2vec_parity.py` (machine `{slug}`; llm2vec {versions['ref_llm2vec']}, "
                 f"transformers {versions['ref_transformers']}, peft {versions['ref_peft']}, torch "
                 f"{versions['ref_torch']} in the reference venv; torch {versions['torch']} for the Engine)")
    lines = ["# Engine vs official llm2vec (SmolLM2-135M-Instruct, mean pooling, float32)", "", reproduce, "", intro,
             "", "| variant | min cos | median cos | llm2vec missing adapter keys |", "|---|---:|---:|---:|"]
    for _, r in table.iterrows():
        lines.append(f"| {r['variant']} | {r['min_cos']:.6f} | {r['median_cos']:.6f} | {r['missing_adapter_keys']} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
