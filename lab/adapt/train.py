"""LLM2Vec-style adaptation of a decoder LLM into an embedder: MNTP, then unsupervised SimCSE, as PEFT LoRA folders.

LLM2Vec (BehnamGhader et al., 2024) turns a decoder's attention bidirectional and then teaches the model to use it:

- **MNTP** (masked next-token prediction): with bidirectional attention, about 20 % of the tokens are replaced (80 %
  by a mask token, 10 % by a random token, 10 % kept, as BERT's collator does) and token ``i`` is predicted from the
  output at position ``i - 1``, the position a decoder's LM head already predicts the next token from. A tokenizer
  without a mask token (Llama, SmolLM2) uses the ``_`` token, as llm2vec's ``blank`` mask type does.
- **Unsupervised SimCSE**: each sentence runs twice with dropout (attention dropout, plus LoRA dropout); the two
  mean-pooled views are positives, the other sentences of the batch negatives (InfoNCE at temperature 0.05).

Training runs through transformers + peft on padded batches, with the texts bucketed by length so little padding
is computed; LoRA sits on the attention and MLP projections. The result is always a standard PEFT LoRA folder
(``adapter_config.json`` + ``adapter_model.safetensors``) with its keys in the bare model's scope
(``base_model.model.layers.N...``): the scope llm2vec (``LLM2Vec.from_pretrained(base, folder)``) and peft over
``AutoModel.from_pretrained(base)`` load, and ``lab.Engine(adapters=[...])`` reads (it also reads the
``*ForCausalLM`` scope; ``lab.adapt.rescope`` converts such folders). ``llm2vec_config.json`` beside it holds
llm2vec's encoder settings (``run_files.LLM2VEC_CONFIG``: mean pooling, max_length 512, instructions not pooled), which
llm2vec and the Engine read as defaults.
Each run writes ``train_log.csv`` (one row per step), ``loss.png`` and ``train_config.json`` beside the adapter,
keeps a checkpoint every ``save_every`` steps (``resume=True`` continues from it, bit for bit the same run), and
is deterministic for a seed. Training needs peft, the ``adapt`` extra (``pip install 'prefill-lab[adapt]'``); an
``ImportError`` naming it comes before any work where it is missing.

This module holds the two entry points and the training loop (loading the model, the optimizer and schedule, the
autocast dtype); ``lab.adapt.objectives`` the batches and the losses, ``lab.adapt.run_files`` the adapter, checkpoint
and log files, ``lab.adapt.peft_lora`` the LoRA's settings (``LoraSpec``).

    >>> from lab.adapt import mntp, simcse
    >>> mntp(base, texts, "runs/mntp", steps=300)
    >>> simcse(base, texts, "runs/mntp_simcse", adapters=["runs/mntp"], steps=200)     # on top of MNTP, merged
    >>> Engine(base, adapters=["runs/mntp", "runs/mntp_simcse"], bidirectional=True, pooling="mean")
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lab._files import atomic_write, make_folder
from lab.adapt.key_scope import is_bare_scope
from lab.adapt.objectives import batch_order, mntp_loss, simcse_loss, tokenize
from lab.adapt.peft_lora import LoraSpec, peft
from lab.adapt.run_files import (
    CHECKPOINT,
    LOG_FILE,
    RESUME_FIX,
    RUN_FILES,
    load_checkpoint,
    machine_info,
    plot_loss,
    save_adapter,
    save_checkpoint,
    texts_hash,
    write_log,
)
from lab.models import hub


@dataclass
class AdaptRun:
    """What one ``mntp`` / ``simcse`` call did. ``log`` has one row per step (step, loss, lr, tokens, seconds).

    >>> run = simcse(base, texts, "runs/simcse", steps=250); run.final_loss, run.path, run.log.loss.iloc[-1]
    """

    path: Path
    objective: str
    steps: int
    resumed_from: int
    seconds: float
    dtype: str
    device: str
    log: object = field(repr=False, default=None)  # pandas DataFrame

    @property
    def final_loss(self) -> float:
        """Mean loss of the last 10 % of steps."""
        tail = self.log["loss"].to_numpy()
        return float(tail[-max(1, len(tail) // 10) :].mean())


# ----------------------------------------------------------------------------------------------------- public
def mntp(
    base: str | os.PathLike,
    texts: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 5e-4,
    mask_rate: float = 0.2,
    max_length: int = 128,
    adapters: Sequence[str | os.PathLike] = (),
    lora: LoraSpec | None = None,
    warmup: float = 0.1,
    seed: int = 0,
    save_every: int = 50,
    resume: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    show_progress: bool = True,
) -> AdaptRun:
    """Masked next-token prediction with bidirectional attention; writes a PEFT LoRA folder to ``out_dir``.

        >>> run = mntp("models/smollm2", texts, "runs/mntp", steps=200)     # then Engine(..., adapters=[run.path])

    Args:
        base: a local decoder model folder (Llama / Mistral / Qwen2 / Qwen3 family, with an LM head or tied one).
        texts: unlabeled training text (never an evaluation test split).
        steps: optimizer steps of ``batch_size`` texts each (texts are cycled in a seeded order).
        mask_rate: share of (non-special, non-first) tokens chosen for prediction.
        max_length: longer texts are cut to this many tokens (counted and warned).
        adapters: earlier PEFT LoRA folders merged into the base first (in order).
        lora: rank, alpha, dropout, targets and storage dtype of the trained LoRA (``LoraSpec()``).
        warmup: share of the steps with a linearly rising learning rate (then linear decay to 0).
        save_every: keep a checkpoint every this many steps; ``resume=True`` continues from it (from the start when
            the run stopped before its first checkpoint, its folder holding only its config and log). A write that
            fails (a full disk, a size limit) is an ``OSError`` naming the folder and what to do.
        device / dtype: ``auto`` (CUDA when present, else CPU; bfloat16 autocast where a short probe finds it
            faster than float32 on this machine), or ``cpu``/``cuda`` and ``float32``/``bfloat16``.
    """
    return _train(
        "mntp",
        base,
        texts,
        out_dir,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        max_length=max_length,
        adapters=adapters,
        lora=lora,
        warmup=warmup,
        seed=seed,
        save_every=save_every,
        resume=resume,
        device=device,
        dtype=dtype,
        show_progress=show_progress,
        bidirectional=True,
        extra={"mask_rate": mask_rate},
    )


def simcse(
    base: str | os.PathLike,
    texts: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    steps: int,
    adapters: Sequence[str | os.PathLike] = (),
    bidirectional: bool = True,
    batch_size: int = 32,
    lr: float = 3e-4,
    temperature: float = 0.05,
    attention_dropout: float = 0.3,
    max_length: int = 64,
    lora: LoraSpec | None = None,
    warmup: float = 0.1,
    seed: int = 0,
    save_every: int = 50,
    resume: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    show_progress: bool = True,
) -> AdaptRun:
    """Unsupervised SimCSE with mean pooling on top of the merged ``adapters``; writes a PEFT LoRA folder.

    Two dropout passes of each batch (``attention_dropout`` in every attention, plus the LoRA dropout) give two
    views per text; the loss is cross-entropy over the batch's cosine similarities / ``temperature``, positives on
    the diagonal. ``bidirectional=False`` trains the causal model (LLM2Vec's control). Other arguments as ``mntp``.

        >>> run = simcse("models/smollm2", texts, "runs/simcse", adapters=["runs/mntp"], steps=250)
    """
    return _train(
        "simcse",
        base,
        texts,
        out_dir,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        max_length=max_length,
        adapters=adapters,
        lora=lora,
        warmup=warmup,
        seed=seed,
        save_every=save_every,
        resume=resume,
        device=device,
        dtype=dtype,
        show_progress=show_progress,
        bidirectional=bidirectional,
        extra={"temperature": temperature, "attention_dropout": attention_dropout},
    )


# ------------------------------------------------------------------------------------------------- training
def _train(
    objective: str,
    base,
    texts,
    out_dir,
    *,
    steps,
    batch_size,
    lr,
    max_length,
    adapters,
    lora,
    warmup,
    seed,
    save_every,
    resume,
    device,
    dtype,
    show_progress,
    bidirectional,
    extra,
) -> AdaptRun:
    import pandas as pd

    lora = lora or LoraSpec()
    _check_args(texts, steps, batch_size, lr, max_length, save_every, lora, extra)
    peft()  # missing: the error names the extra before anything is read or written
    source = hub.resolve(base, what="base model")  # a hub id: its snapshot, fetched when the hub can be reached
    base = source.folder
    if not (base / "config.json").exists():
        raise FileNotFoundError(
            f"{str(base)!r} is not a model folder (no config.json); pass a base model folder or its hub id"
        )
    adapters = [str(hub.resolve(a, what="adapter").folder) for a in adapters]
    out = Path(out_dir).expanduser()
    ckpt = out / CHECKPOINT
    # a run that stopped before its first checkpoint leaves only its config and log: resume=True starts it again
    restart = resume and out.exists() and {p.name for p in out.iterdir()} <= RUN_FILES
    if out.exists() and any(out.iterdir()) and not (resume and ckpt.exists()) and not restart:
        if (out / "adapter_config.json").exists() and resume:
            raise FileExistsError(f"{str(out)!r} already holds a finished adapter; nothing to resume")
        raise FileExistsError(
            f"{str(out)!r} is not empty; pass resume=True to continue its checkpoint, or a new out_dir"
        )
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    config = dict(
        objective=objective,
        base=str(base.resolve()),
        adapters=[str(Path(a).resolve()) for a in adapters],
        bidirectional=bidirectional,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        max_length=max_length,
        warmup=warmup,
        seed=seed,
        lora=asdict(lora),
        texts=len(texts),
        texts_sha1=texts_hash(texts),
        **extra,
    )
    config = json.loads(json.dumps(config))  # as train_config.json holds it (tuples become lists)
    if resume and ckpt.exists():
        saved = json.loads((out / "train_config.json").read_text())
        changed = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
        if changed:
            raise ValueError(f"resume=True but the run's settings differ from the checkpoint's: {changed}")

    torch.manual_seed(seed)
    model, tok = _load(base, adapters, bidirectional, lora, dev, extra.get("attention_dropout", 0.0))
    ids = tokenize(tok, texts, max_length)
    order = batch_order(ids, batch_size, steps, seed)
    loss_fn = (
        mntp_loss(model, tok, ids, extra["mask_rate"], seed)
        if objective == "mntp"
        else simcse_loss(model, tok, ids, extra["temperature"])
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, round(warmup * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm))
    )
    amp = _choose_dtype(dtype, dev, lambda: loss_fn(order[0], 0)[0], params)

    start, rows = 0, []
    if resume and ckpt.exists():
        start, rows = load_checkpoint(ckpt, model, opt, sched)
    else:
        make_folder(out, f"the {objective} adapter", "pass an out_dir that can be written")
        atomic_write(
            out / "train_config.json", json.dumps({**config, "machine": machine_info()}, indent=2).encode(), RESUME_FIX
        )
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, desc=objective, unit="step")
    model.train()
    t0 = time.perf_counter()
    try:
        for step in range(start, steps):
            ts = time.perf_counter()
            with torch.autocast(dev.type, dtype=amp, enabled=amp != torch.float32):
                loss, tokens = loss_fn(order[step], step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            rows.append(
                {
                    "step": step + 1,
                    "loss": loss.item(),
                    "lr": sched.get_last_lr()[0],
                    "tokens": tokens,
                    "seconds": time.perf_counter() - ts,
                }
            )
            sched.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}")
            if (step + 1) % save_every == 0 and step + 1 < steps:
                save_checkpoint(ckpt, model, opt, sched, step + 1, rows, lora)
    except BaseException:
        if rows:  # what ran is kept, even on an interrupt; the error in flight is the one to see
            with contextlib.suppress(OSError):
                write_log(rows, out / LOG_FILE)
        raise
    finally:
        if bar is not None:
            bar.close()
    if rows:
        write_log(rows, out / LOG_FILE)
    save_adapter(model, out, lora, base=source)
    shutil.rmtree(ckpt, ignore_errors=True)
    model = opt = sched = loss_fn = params = None
    gc.collect()  # peft's wrappers hold reference cycles: free this run's model before the next one loads
    log = pd.DataFrame(rows)
    plot_loss(log, out / "loss.png", objective)
    return AdaptRun(
        path=out,
        objective=objective,
        steps=steps,
        resumed_from=start,
        seconds=time.perf_counter() - t0,
        dtype=str(amp).removeprefix("torch."),
        device=str(dev),
        log=log,
    )


def _check_args(texts, steps, batch_size, lr, max_length, save_every, lora: LoraSpec, extra) -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts[{bad}] is {type(texts[bad]).__name__}, not a string")
    if sum(bool(t.strip()) for t in texts) < 2:
        raise ValueError("texts needs at least two non-empty texts to train on")
    for name, v in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("max_length", max_length),
        ("save_every", save_every),
        ("r", lora.r),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if batch_size < 2 and "temperature" in extra:
        raise ValueError("SimCSE needs batch_size >= 2 (the other texts of a batch are its negatives)")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    if "mask_rate" in extra and not 0 < extra["mask_rate"] < 1:
        raise ValueError(f"mask_rate must be in (0, 1), got {extra['mask_rate']!r}")
    if lora.save_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"LoraSpec.save_dtype must be float32, bfloat16 or float16, got {lora.save_dtype!r}")


def _load(base: Path, adapters, bidirectional: bool, lora: LoraSpec, dev: torch.device, attention_dropout: float):
    """The base (earlier adapters merged, in order) with a fresh trainable LoRA; attention made bidirectional."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lib = peft()

    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        str(base),
        dtype=torch.float32,
        local_files_only=True,
        attention_dropout=attention_dropout,
        trust_remote_code=False,
    )
    for a in adapters:
        if not (Path(a) / "adapter_config.json").exists():
            raise FileNotFoundError(f"{str(a)!r} holds no PEFT adapter (no adapter_config.json)")
        if is_bare_scope(a):  # saved from the bare model: loaded onto the ForCausalLM's inner one (``model``)
            model.model = lib.PeftModel.from_pretrained(model.model, str(a)).merge_and_unload()
        else:  # saved from the *ForCausalLM (keys base_model.model.model.layers...)
            model = lib.PeftModel.from_pretrained(model, str(a)).merge_and_unload()
    set_bidirectional(model, bidirectional)
    cfg = lib.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    model = lib.get_peft_model(model, cfg).to(dev)
    return model, tok


def set_bidirectional(model, bidirectional: bool) -> None:
    """Make every attention module of a transformers decoder (non-)causal. Both the config flag (read by the mask
    builder) and each module's ``is_causal`` (read by SDPA when no mask is needed) must change: the flag alone
    leaves an unpadded batch causal."""
    model.config.is_causal = not bidirectional
    for m in model.modules():
        if hasattr(m, "is_causal") and isinstance(m.is_causal, bool):
            m.is_causal = not bidirectional
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "is_causal"):
            cfg.is_causal = not bidirectional


def cpu_bf16_native(flags: str | None = None) -> bool:
    """Whether this CPU (or one with ``flags``, ``lab.ops.probes.cpu_info``'s ``cpu_flags``) computes in bfloat16
    natively: ``avx512_bf16`` or ``amx_bf16``."""
    from lab.ops.probes import cpu_info

    have = set((cpu_info()["cpu_flags"] if flags is None else flags).split())
    return bool(have & {"avx512_bf16", "amx_bf16"})


def _choose_dtype(dtype: str, dev: torch.device, one_loss: Callable, params) -> torch.dtype:
    """``float32`` / ``bfloat16`` as asked; ``auto``: bfloat16 on CUDA; on a CPU without native bfloat16 arithmetic
    (neither ``avx512_bf16`` nor ``amx_bf16``), float32 without a probe (there a bfloat16 backward is emulated, many
    times slower than float32, and the probe alone would cost minutes); on other CPUs, whichever of float32 and
    bfloat16 autocast ran one forward + backward of the first batch faster (one timed run after a warm-up each). The
    probe's gradients are discarded; it draws no random numbers the run uses (dropout aside, reseeded after)."""
    if dtype in ("float32", "fp32"):
        return torch.float32
    if dtype in ("bfloat16", "bf16"):
        return torch.bfloat16
    if dtype != "auto":
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if dev.type == "cuda":
        return torch.bfloat16
    if not cpu_bf16_native():
        return torch.float32
    state = torch.get_rng_state()
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        for timed in (False, True):  # a warm-up, then the timed run
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=dt, enabled=dt != torch.float32):
                loss = one_loss()
            loss.backward()
            if timed:
                times[dt] = time.perf_counter() - t
    for p in params:
        p.grad = None
    torch.set_rng_state(state)
    return min(times, key=times.get)
