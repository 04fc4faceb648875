"""The files a training run writes and reads back: the finished adapter (the PEFT layout in the bare model's
scope, ``llm2vec_config.json`` beside it: ``save_adapter``), the resumable checkpoint (adapter, optimizer, scheduler
and RNG state, swapped in whole: ``save_checkpoint`` / ``load_checkpoint``), ``train_log.csv`` (``write_log``),
``loss.png`` (``plot_loss``) and what ``train_config.json`` records of the texts and the machine (``texts_hash``,
``machine_info``). A write that fails is an ``OSError`` naming the folder and ``RESUME_FIX``.
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lab._files import NO_ROOM, atomic_write, staged, write_failed
from lab.adapt.key_scope import bare_config, bare_key
from lab.adapt.peft_lora import LoraSpec, peft
from lab.models import hub

CHECKPOINT = "checkpoint"
LOG_FILE = "train_log.csv"
RUN_FILES = {"train_config.json", LOG_FILE, ".adapter.tmp", CHECKPOINT + ".tmp", CHECKPOINT + ".old"}  # not results
# what to do when the adapter folder cannot be written (a full disk, a size limit)
RESUME_FIX = (
    f"{NO_ROOM}, then run again with resume=True (it continues from the last checkpoint); or pass another out_dir"
)

# llm2vec_config.json beside a finished adapter: the keys llm2vec's LLM2Vec.save writes and from_pretrained reads.
# Mean pooling (what SimCSE trains, llm2vec's default), llm2vec's default inference lengths, instructions not pooled.
LLM2VEC_CONFIG = {"pooling_mode": "mean", "max_length": 512, "doc_max_length": 400, "skip_instruction": True}


def save_adapter(model, out: Path, lora: LoraSpec, *, bare: bool = True, base: hub.Source | None = None) -> None:
    """The standard PEFT layout: ``adapter_config.json`` + ``adapter_model.safetensors`` (in ``save_dtype``).
    ``bare``: keys in the bare model's scope (``base_model.model.layers.N...``, what llm2vec and peft over
    ``AutoModel`` load) and ``llm2vec_config.json`` beside them; ``False`` keeps the training model's
    ``*ForCausalLM`` scope (checkpoints, which ``set_peft_model_state_dict`` reads back into that model).
    ``base``: a base named by hub id is written as that id (``base_model_name_or_path``) and its commit
    (``revision``), so the adapter loads on any machine, as peft and llm2vec read those keys."""
    tmp = out / ".adapter.tmp"
    with staged(tmp, lambda e: write_failed(e, out / "adapter_model.safetensors", None, RESUME_FIX)):
        _write_adapter(model, tmp, out, lora, bare=bare, base=base)


def _write_adapter(model, tmp: Path, out: Path, lora: LoraSpec, *, bare: bool, base: hub.Source | None) -> None:
    """``save_adapter``'s files, written into ``tmp`` and then moved into ``out``."""
    from safetensors.torch import save_file

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.peft_config["default"].save_pretrained(str(tmp))
    sd = peft().get_peft_model_state_dict(model)
    dt = getattr(torch, lora.save_dtype)
    rename = bare_key if bare else str
    save_file(
        {rename(k): v.detach().to("cpu", dt).contiguous() for k, v in sd.items()},
        str(tmp / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    if bare:
        cfg = tmp / "adapter_config.json"
        written = bare_config(json.loads(cfg.read_text()))
        if base is not None and base.repo_id:
            written.update(base_model_name_or_path=base.repo_id, revision=base.revision)
        cfg.write_text(json.dumps(written, indent=2, sort_keys=True))
        (tmp / "llm2vec_config.json").write_text(json.dumps(LLM2VEC_CONFIG, indent=4))
    # adapter_config.json last: it marks a folder as a finished adapter (resume refuses one), so a run killed while
    # the files move leaves no config beside missing weights, and resume=True finishes the move from the checkpoint
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "adapter_config.json"):
        os.replace(f, out / f.name)
    tmp.rmdir()


def save_checkpoint(ckpt: Path, model, opt, sched, step: int, rows: list[dict], lora: LoraSpec) -> None:
    """Adapter + optimizer + scheduler + RNG state, written to a temp folder and swapped in whole."""
    import pandas as pd

    tmp = ckpt.with_name(CHECKPOINT + ".tmp")
    with staged(tmp, lambda e: write_failed(e, ckpt, None, RESUME_FIX)):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_adapter(
            model,
            tmp / ".adapter.tmp",
            tmp,
            LoraSpec(**{**asdict(lora), "save_dtype": "float32"}),
            bare=False,
            base=None,
        )
        state = io.BytesIO()  # torch.save reports a failed file write as a RuntimeError: the file is written here
        torch.save(
            {
                "step": step,
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
            },
            state,
        )
        (tmp / "trainer_state.pt").write_bytes(state.getvalue())
        pd.DataFrame(rows).to_csv(tmp / LOG_FILE, index=False)
    old = ckpt.with_name(CHECKPOINT + ".old")
    if ckpt.exists():
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    shutil.rmtree(old, ignore_errors=True)
    write_log(rows, ckpt.parent / LOG_FILE)


def write_log(rows: list[dict], path: Path) -> None:
    """The training log (one row per step) written whole."""
    import pandas as pd

    atomic_write(path, pd.DataFrame(rows).to_csv(index=False).encode("utf-8"), RESUME_FIX)


def load_checkpoint(ckpt: Path, model, opt, sched) -> tuple[int, list[dict]]:
    import pandas as pd
    from safetensors.torch import load_file

    peft().set_peft_model_state_dict(model, load_file(str(ckpt / "adapter_model.safetensors")))
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    rows = pd.read_csv(ckpt / LOG_FILE).to_dict("records")
    return int(state["step"]), rows


def plot_loss(log, path: Path, objective: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(log["step"], log["loss"], lw=0.8, alpha=0.4, label="per step")
    if len(log) >= 5:
        k = max(5, len(log) // 20)
        ax.plot(log["step"], log["loss"].rolling(k, min_periods=1).mean(), lw=2, label=f"mean of {k}")
    ax.set(xlabel="step", ylabel="loss", title=f"{objective}: training loss")
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def texts_hash(texts: Sequence[str]) -> str:
    import hashlib

    h = hashlib.sha1()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
