"""The Engine against the official llm2vec 0.2.3, the way llm2vec's users run it, on held-out STS sentences and SciFact
abstracts.

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
already in that scope). A variant is a ``Variant`` row; two kinds:

- *settings given* (the first six rows): every setting passed on both sides (llm2vec: ``enable_bidirectional``,
  ``merge_peft=True``, mean pooling, ``max_length`` 512, ``skip_instruction``; the Engine: the same knobs,
  ``instruction_pooling="llm2vec"`` in the instruction row), over the -mntp folder above: causal and bidirectional
  base, + MNTP, + SimCSE, with an instruction, and the ``control`` row, which loads copies whose keys are put in the
  ``*ForCausalLM`` scope (``causal_scoped``: ``base_model.model.model.layers...``, tensors unchanged) to show what
  llm2vec does with adapters saved that way (peft warns "Found missing adapter keys" and leaves every ``lora_B`` at
  zero), while the Engine reads both scopes alike;
- *plain* (the rest): called as llm2vec's users call it, ``LLM2Vec.from_pretrained(mntp,
  peft_model_name_or_path=supervised, torch_dtype=torch.float32)`` and ``Engine(mntp, adapters=[supervised],
  dtype="float32", device="cpu")``, nothing else, so each side takes its settings from the folders
  (``published_folders``: the published layout, the -mntp ``config.json`` with ``_name_or_path`` and an
  ``auto_map`` to ``modeling_llama_encoder.LlamaEncoderModel``, a supervised folder without ``llm2vec_config.json``):
  the published layout as it is (llm2vec's class defaults), with and without an instruction; a non-default
  ``llm2vec_config.json`` only in the -mntp folder (ignored when a supervised adapter is given, applied when not)
  and only in the supervised folder (weighted_mean / max_length 128 / skip_instruction false; eos_token); SciFact
  abstracts over ``doc_max_length`` (the default 400; 64 from the supervised config; 200 under max_length 128, where
  llm2vec's count, truncated at max_length, never exceeds it); each chat template llm2vec 0.2.3 chooses by
  ``_name_or_path`` (``TEMPLATED``: the -mntp ``config.json`` naming Llama-3-8B-Instruct, Mistral-7B-Instruct-v0.2,
  Llama-2-7b-chat, gemma-2-9b-it, Qwen2-1.5B / 7B-Instruct over SmolLM2's weights; two with eos_token pooling); and
  the published layout named by hub ids (``McGill-NLP/...-mntp`` and ``...-mntp-supervised``, the -mntp adapter's
  base the base's id) from a hub cache written in the temporary folder (``HF_HUB_CACHE`` for both processes,
  offline), once with the -mntp ``config.json``'s ``_name_or_path`` and the base's id naming the same model and once
  with them differing (the -mntp ``config.json`` naming Llama-3-8B-Instruct, the base SmolLM2's id): by hub id
  llm2vec's template follows the base's id, which transformers 4.44 records as ``_name_or_path`` when it loads a
  folder holding an adapter (it loads ``base_model_name_or_path``), and llm2vec overwrites it with the folder's
  ``config.json`` value only for a local folder.

Inputs are llm2vec's ``[[instruction, text]]`` pairs (``""`` without an instruction); float32, no normalization.

Writes ``evals/results/llm2vec_parity/llm2vec_parity_<machine_slug>.csv`` (one row per variant: min and median
cosine between the two embeddings of each input, the settings each side ended with, the inputs llm2vec's document
cut shortened, llm2vec's missing adapter keys, timings, versions) and a short ``.md`` beside it.

    python evals/llm2vec_parity.py                       # 300 sentences, 100 abstracts, the venv made if missing
    python evals/llm2vec_parity.py --venv /path/to/venv --sentences 100 --documents 40

This file is the command line and the run; its parts, in ``evals/``: ``llm2vec_parity_variants`` (the rows) and
``llm2vec_parity_folders`` (the folders both sides read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# after the path set-up: this runs as a script
from evals.criteria import row_cosines
from evals.data_io import DATA, read_jsonl, scifact_text, spread
from evals.llm2vec_parity_folders import build_folders, published_folders
from evals.llm2vec_parity_variants import VARIANTS, Variant
from lab import env

REF = ROOT / "evals" / "llm2vec_ref"
OUT = ROOT / "evals" / "results" / "llm2vec_parity"
DEFAULT_VENV = env.path("LAB_LLM2VEC_VENV", Path.home() / ".cache" / "prefill-lab" / "venvs" / "llm2vec")
STS_FILES = ("sts12/test.jsonl.gz", "sts14/test.jsonl.gz", "sts16/test.jsonl.gz")  # held out of the study's training
# llm2vec's encoder settings and the Engine knobs that mean the same
LLM2VEC_ENCODER = {"pooling_mode": "mean", "max_length": 512, "skip_instruction": True}
ENGINE_KNOBS = {
    "pooling": "mean",
    "max_length": 512,
    "include_instruction": False,
    "normalize": False,
    "dtype": "float32",
    "device": "cpu",
}
PLAIN_KNOBS = {"dtype": "float32", "device": "cpu"}  # what the plain rows pass the Engine


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


def texts_for(v: Variant, sts: list[str], documents: int) -> list[str]:
    """A row's inputs: the STS sentences, or ``documents`` SciFact abstracts (``scifact_text``) spread over the
    longest third of the corpus by words, so llm2vec's default ``doc_max_length`` 400 cuts many of them."""
    if v.texts == "sts":
        return sts
    docs = sorted(
        (scifact_text(r) for r in read_jsonl(DATA / "scifact" / "corpus.jsonl.gz")),
        key=lambda t: len(t.split()),
        reverse=True,
    )
    docs = docs[: len(docs) // 3]
    return [docs[i] for i in spread(len(docs), documents)]


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


def run_llm2vec(py: Path, v: Variant, names: tuple[str, str | None], texts: list[str], work: Path):
    import numpy as np

    tag = "".join(c if c.isalnum() else "_" for c in v.name)
    model, peft = names
    job = {
        "model": model,
        "peft": peft,
        "inputs": [[v.instruction, t] for t in texts],
        "out": str(work / f"{tag}.npy"),
        "report": str(work / f"{tag}.json"),
    }
    if not v.plain:  # the settings rows: every encoder setting given, the adapters merged
        job.update({"bidirectional": v.bidirectional, "encoder": LLM2VEC_ENCODER, "merge_peft": True})
    (work / f"{tag}.job.json").write_text(json.dumps(job))
    env = {k: val for k, val in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(py), str(REF / "run_llm2vec.py"), str(work / f"{tag}.job.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llm2vec failed on {v.name!r}:\n{done.stderr[-4000:]}")
    return np.load(job["out"]), json.loads(Path(job["report"]).read_text())


def names_for(v: Variant, folders: dict[str, Path]) -> tuple[str, str | None]:
    """The model and peft names of a settings row (the folders ``build_folders`` made)."""
    model = folders["base"] if v.model == "base" else folders[f"mntp:{v.scope}"]
    return str(model), str(folders[f"simcse:{v.scope}"]) if v.peft else None


def run_engine(v: Variant, names: tuple[str, str | None], texts: list[str]):
    from lab import Engine

    model, peft = names
    knobs = PLAIN_KNOBS if v.plain else {"bidirectional": v.bidirectional, **ENGINE_KNOBS, **v.knobs}
    t0 = time.perf_counter()
    eng = Engine(model, adapters=[peft] if peft else [], **knobs)
    out = eng.embed(texts, instruction=v.instruction or None)
    return out, time.perf_counter() - t0, eng


@contextlib.contextmanager
def hub_cache_at(folder: Path):
    """``HF_HUB_CACHE`` at ``folder`` for this process (huggingface_hub's constant too, when it is imported already)
    and the llm2vec subprocesses, restored after."""
    folder.mkdir(parents=True)
    before = os.environ.get("HF_HUB_CACHE")
    constants = sys.modules.get("huggingface_hub.constants")
    was = getattr(constants, "HF_HUB_CACHE", None)
    os.environ["HF_HUB_CACHE"] = str(folder)
    if constants is not None:
        constants.HF_HUB_CACHE = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("HF_HUB_CACHE", None)
        else:
            os.environ["HF_HUB_CACHE"] = before
        if constants is not None:
            constants.HF_HUB_CACHE = was


def main(argv: list[str] | None = None) -> int:
    import pandas as pd
    import torch

    from lab.ops.probes import machine_slug

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the llm2vec reference environment")
    ap.add_argument("--sentences", type=int, default=300)
    ap.add_argument("--documents", type=int, default=100, help="SciFact abstracts of the document rows")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--variants", nargs="+", default=None, help="run only these variants (names as in VARIANTS)")
    args = ap.parse_args(argv)
    chosen = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
    if not chosen:
        raise SystemExit(f"no variant named {args.variants}; valid: {[v.name for v in VARIANTS]}")
    py = ensure_venv(args.venv)
    sts = sentences(args.sentences)
    rows = []
    with tempfile.TemporaryDirectory(prefix="llm2vec-parity-") as tmp, hub_cache_at(Path(tmp) / "hub") as hub_cache:
        work = Path(tmp)
        folders = build_folders(work)
        for v in chosen:
            names = published_folders(v, folders, work, hub_cache) if v.plain else names_for(v, folders)
            texts = texts_for(v, sts, args.documents)
            theirs, report = run_llm2vec(py, v, names, texts, work)
            ours, engine_s, eng = run_engine(v, names, texts)
            cos = row_cosines(ours, theirs).tolist()
            ref = report["config"]
            rows.append(
                {
                    "variant": v.name,
                    "model": "-mntp folder" if v.model == "mntp" else "base",
                    "layout": ("hub ids" if v.hub else "published") if v.plain else "settings given",
                    "adapters": "+".join(Path(a).name for a in eng.knobs["adapters"]) or "none",
                    "key_scope": v.scope if v.model == "mntp" else "",
                    "bidirectional": not eng.resolved.causal,
                    "instruction": v.instruction,
                    "texts": v.texts,
                    "sentences": len(texts),
                    "docs_cut": sum(a != b for a, b in zip(eng.cut_documents(texts), texts)),
                    "min_cos": min(cos),
                    "median_cos": statistics.median(cos),
                    "missing_adapter_keys": report["missing_adapter_keys"],
                    "llm2vec_seconds": round(report["load_seconds"] + report["encode_seconds"], 2),
                    "engine_seconds": round(engine_s, 2),
                    "pooling": eng.resolved["pooling"],
                    "max_length": eng.resolved["max_length"],
                    "doc_max_length": eng.resolved.doc_max_length,
                    "include_instruction": eng.resolved.include_instruction,
                    "template_name": eng.llm2vec.name,
                    "ref_pooling": ref["pooling_mode"],
                    "ref_max_length": ref["max_length"],
                    "ref_doc_max_length": ref["doc_max_length"],
                    "ref_skip_instruction": ref["skip_instruction"],
                    "ref_name_or_path": ref["name_or_path"],
                    "ref_model_class": ref["model_class"],
                    **{f"ref_{k}": val for k, val in report["versions"].items()},
                    "torch": torch.__version__,
                }
            )
            print(
                f"{v.name}: min cos {min(cos):.6f}, median {statistics.median(cos):.6f}, "
                f"missing adapter keys {report['missing_adapter_keys']}; llm2vec {ref}, Engine "
                f"{rows[-1]['pooling']}/{rows[-1]['max_length']}/{rows[-1]['doc_max_length']}/"
                f"include_instruction={rows[-1]['include_instruction']}/{rows[-1]['template_name']!r}",
                flush=True,
            )
    from evals.results_index import save_run

    slug = machine_slug()
    table = pd.DataFrame(rows)
    csv = save_run(table, args.out, "llm2vec_parity", slug=slug, extra={".md": markdown(table, slug)})
    print(f"wrote {csv}")
    return 0


def markdown(table, slug: str) -> str:
    """The ``.md`` beside the CSV: how the rows were made, and one line per variant."""
    versions = table.iloc[0]
    sts = table[table["texts"] == "sts"]["sentences"]
    docs = table[table["texts"] == "scifact"]["sentences"]
    inputs = f"{int(sts.iloc[0]) if len(sts) else 0} distinct sentences of STS12/14/16 test" + (
        f" (the SciFact rows: {int(docs.iloc[0])} abstracts of the corpus's longest third)" if len(docs) else ""
    )
    intro = (
        f"{inputs}; cosine between llm2vec's and the Engine's embedding of each. Adapters: the study's MNTP and "
        "SimCSE (`evals/results/llm2vec`), rescoped with `lab.adapt.rescope`."
    )
    settings = (
        "*settings given* rows: the -mntp folder is the base's config and tokenizer beside the MNTP adapter, "
        "llm2vec called with every encoder setting (mean, 512, skip_instruction, `enable_bidirectional`, "
        "`merge_peft=True`) and the Engine with the same knobs. The control row loads copies with the keys in "
        "the ForCausalLM scope (`causal_scoped`, tensors unchanged): llm2vec's peft misses their keys and "
        "runs without them."
    )
    plain = (
        "*published* and *hub ids* rows: called as llm2vec's users call it, "
        "`LLM2Vec.from_pretrained(mntp, peft_model_name_or_path=supervised, torch_dtype=float32)` and "
        "`Engine(mntp, adapters=[supervised], dtype='float32', device='cpu')`, nothing else; the -mntp folder "
        "holds a config.json with `_name_or_path` (the template name) and an `auto_map` to "
        "`modeling_llama_encoder.LlamaEncoderModel`, the tokenizer and the MNTP adapter; the supervised folder "
        "holds the SimCSE adapter; `llm2vec_config.json` only where the row says. *hub ids* rows name both by "
        "hub id from an offline hub cache, the -mntp adapter's base by the base's id. The settings columns are "
        "what each side ended with (llm2vec: its attributes and `model.config._name_or_path`; the Engine: "
        "`eng.resolved` and `eng.llm2vec.name`); *cut* counts the inputs llm2vec's doc_max_length rule "
        "shortened."
    )
    reproduce = (
        f"Reproduce: `python evals/llm2vec_parity.py` (machine `{slug}`; llm2vec {versions['ref_llm2vec']}, "
        f"transformers {versions['ref_transformers']}, peft {versions['ref_peft']}, torch "
        f"{versions['ref_torch']} in the reference venv; torch {versions['torch']} for the Engine)"
    )
    lines = [
        "# Engine vs official llm2vec (SmolLM2-135M-Instruct, float32)",
        "",
        reproduce,
        "",
        intro,
        "",
        settings,
        "",
        plain,
        "",
        (
            "| variant | layout | min cos | median cos | llm2vec: pooling / max / doc max / skip instr. / name | "
            "Engine: pooling / max / doc max / incl. instr. / name | cut | missing adapter keys |"
        ),
        "|---|---|---:|---:|---|---|---:|---:|",
    ]
    for _, r in table.iterrows():
        name = r["ref_name_or_path"] or '""'  # llm2vec's name for a config.json without _name_or_path
        ref = (
            f"{r['ref_pooling']} / {r['ref_max_length']} / {r['ref_doc_max_length']} / "
            f"{r['ref_skip_instruction']} / {name}"
        )
        cut = (
            "off"
            if r["doc_max_length"] != r["doc_max_length"] or not r["doc_max_length"]
            else int(r["doc_max_length"])
        )
        ours = f"{r['pooling']} / {r['max_length']} / {cut} / {r['include_instruction']} / {r['template_name']}"
        lines.append(
            f"| {r['variant']} | {r['layout']} | {r['min_cos']:.6f} | {r['median_cos']:.6f} | {ref} | "
            f"{ours} | {r['docs_cut']} | {r['missing_adapter_keys']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
