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
llm2vec's encoder settings (``LLM2VEC_CONFIG``: mean pooling, max_length 512, instructions not pooled), which
llm2vec and the Engine read as defaults.
Each run writes ``train_log.csv`` (one row per step), ``loss.png`` and ``train_config.json`` beside the adapter,
keeps a checkpoint every ``save_every`` steps (``resume=True`` continues from it, bit for bit the same run), and
is deterministic for a seed. Training needs peft, the ``adapt`` extra (``pip install 'prefill-lab[adapt]'``); an
``ImportError`` naming it comes before any work where it is missing.

    >>> from lab.adapt import mntp, simcse
    >>> mntp(base, texts, "runs/mntp", steps=300)
    >>> simcse(base, texts, "runs/mntp_simcse", adapters=["runs/mntp"], steps=200)     # on top of MNTP, merged
    >>> Engine(base, adapters=["runs/mntp", "runs/mntp_simcse"], bidirectional=True, pooling="mean")
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from lab._extras import require
from lab._files import NO_ROOM, atomic_write, make_folder, staged, write_failed
from lab.adapt.key_scope import bare_config, bare_key, is_bare_scope
from lab.models import hub

# LoRA targets: Llama-family names for the attention and MLP projections (what llm2vec adapts)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT = "checkpoint"
LOG_FILE = "train_log.csv"
RUN_FILES = {"train_config.json", LOG_FILE, ".adapter.tmp", CHECKPOINT + ".tmp", CHECKPOINT + ".old"}  # not results
# what to do when the adapter folder cannot be written (a full disk, a size limit)
RESUME_FIX = (
    f"{NO_ROOM}, then run again with resume=True (it continues from the last checkpoint); or pass another out_dir"
)


@dataclass
class LoraSpec:
    """The LoRA that is trained: rank, alpha, dropout, target modules, and the dtype the adapter is stored in.

    >>> run = mntp(base, texts, "runs/mntp", steps=200, lora=LoraSpec(r=16, alpha=32.0, save_dtype="bfloat16"))
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    save_dtype: str = "float32"  # "bfloat16" halves the folder; the Engine and peft read either


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
        texts_sha1=_texts_hash(texts),
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
    ids = _tokenize(tok, texts, max_length)
    order = _batch_order(ids, batch_size, steps, seed)
    loss_fn = (
        _mntp_loss(model, tok, ids, extra["mask_rate"], seed)
        if objective == "mntp"
        else _simcse_loss(model, tok, ids, extra["temperature"])
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
        start, rows = _load_checkpoint(ckpt, model, opt, sched)
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
                _save_checkpoint(ckpt, model, opt, sched, step + 1, rows, lora)
    except BaseException:
        if rows:  # what ran is kept, even on an interrupt; the error in flight is the one to see
            with contextlib.suppress(OSError):
                _write_log(rows, out / LOG_FILE)
        raise
    finally:
        if bar is not None:
            bar.close()
    if rows:
        _write_log(rows, out / LOG_FILE)
    _save_adapter(model, out, lora, base=source)
    shutil.rmtree(ckpt, ignore_errors=True)
    model = opt = sched = loss_fn = params = None
    gc.collect()  # peft's wrappers hold reference cycles: free this run's model before the next one loads
    log = pd.DataFrame(rows)
    _plot_loss(log, out / "loss.png", objective)
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


def peft():
    """The ``peft`` module; an ``ImportError`` naming the ``adapt`` extra where it is not installed."""
    return require("peft", extra="adapt", purpose="training LoRA adapters (lab.adapt.train: mntp, simcse)")


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


def _tokenize(tok, texts: Sequence[str], max_length: int) -> list[np.ndarray]:
    enc = tok(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
    cut = sum(len(e) > max_length for e in enc)
    if cut:
        warnings.warn(
            f"{cut} of {len(enc)} training texts were longer than max_length={max_length} tokens and were cut",
            stacklevel=4,
        )
    return [np.asarray(e[:max_length], dtype=np.int64) for e in enc if len(e)]


def _batch_order(ids: list[np.ndarray], batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Indices of each step's batch: the texts shuffled (reshuffled per pass), then sorted by length within windows
    of 50 batches so a batch pads little, and those batches shuffled. Fixed by the seed."""
    rng = np.random.default_rng(seed)
    lengths = np.array([len(x) for x in ids])
    batch_size = min(batch_size, len(ids))
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(len(ids))
        batches = []
        for w in range(0, len(perm), 50 * batch_size):
            win = perm[w : w + 50 * batch_size]
            win = win[np.argsort(lengths[win], kind="stable")]
            batches += [win[i : i + batch_size] for i in range(0, len(win) - batch_size + 1, batch_size)]
        out += [batches[i] for i in rng.permutation(len(batches))]
    return out[:steps]


def _pad(tok, ids: list[np.ndarray], dev) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(x) for x in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out = np.full((len(ids), longest), pad, dtype=np.int64)
    mask = np.zeros((len(ids), longest), dtype=np.int64)
    for i, x in enumerate(ids):
        out[i, : len(x)], mask[i, : len(x)] = x, 1
    return torch.from_numpy(out).to(dev), torch.from_numpy(mask).to(dev)


def _inner(model):
    """(decoder stack, LM head) of a peft-wrapped ``*ForCausalLM``; LoRA layers live inside them."""
    causal_lm = model.get_base_model()
    return causal_lm.model, causal_lm.get_output_embeddings()


def mask_token_id(tok) -> int:
    """The tokenizer's mask token, else ``_`` (llm2vec's ``blank`` choice for tokenizers without one)."""
    if tok.mask_token_id is not None:
        return tok.mask_token_id
    tid = tok.convert_tokens_to_ids("_")
    if tid is None or tid == tok.unk_token_id:
        tid = tok("_", add_special_tokens=False)["input_ids"][-1]
    return int(tid)


def _mntp_loss(model, tok, ids, mask_rate: float, seed: int) -> Callable:
    stack, head = _inner(model)
    dev = next(model.parameters()).device
    mask_id = mask_token_id(tok)
    special = torch.tensor(sorted(set(tok.all_special_ids)), dtype=torch.long)
    vocab = head.weight.shape[0]

    def loss(batch: np.ndarray, step: int):
        x, attn = _pad(tok, [ids[i] for i in batch], "cpu")
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + step)  # per step: a resumed run masks alike
        can = attn.bool() & ~torch.isin(x, special)
        can[:, 0] = False  # token 0 has no position before it to be predicted from
        chosen = (torch.rand(x.shape, generator=g) < mask_rate) & can
        if not chosen.any():  # at least one target per batch
            flat = can.flatten().nonzero()[:, 0]
            chosen.view(-1)[flat[torch.randint(len(flat), (1,), generator=g)]] = True
        roll = torch.rand(x.shape, generator=g)
        inputs = x.clone()
        inputs[chosen & (roll < 0.8)] = mask_id
        rand = chosen & (roll >= 0.8) & (roll < 0.9)
        inputs[rand] = torch.randint(vocab, (int(rand.sum()),), generator=g)
        b, i = chosen.nonzero(as_tuple=True)
        h = stack(input_ids=inputs.to(dev), attention_mask=attn.to(dev)).last_hidden_state  # (B, L, H)
        logits = head(h[b.to(dev), (i - 1).to(dev)])  # (targets, V): token i from position i - 1
        return torch.nn.functional.cross_entropy(logits.float(), x[b, i].to(dev)), int(attn.sum())

    return loss


def _simcse_loss(model, tok, ids, temperature: float) -> Callable:
    stack, _ = _inner(model)
    dev = next(model.parameters()).device

    def loss(batch: np.ndarray, step: int):
        x, attn = _pad(tok, [ids[i] for i in batch], dev)
        h = stack(input_ids=torch.cat([x, x]), attention_mask=torch.cat([attn, attn])).last_hidden_state
        m = torch.cat([attn, attn]).unsqueeze(-1).to(h.dtype)
        z = ((h * m).sum(1) / m.sum(1)).float()  # (2B, H) mean pooling
        z = torch.nn.functional.normalize(z, dim=-1)
        n = len(batch)
        sim = z[:n] @ z[n:].T / temperature  # (B, B): view 1 against view 2
        return torch.nn.functional.cross_entropy(sim, torch.arange(n, device=dev)), int(attn.sum()) * 2

    return loss


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


# ------------------------------------------------------------------------------------------ files: adapter, log
# llm2vec_config.json beside a finished adapter: the keys llm2vec's LLM2Vec.save writes and from_pretrained reads.
# Mean pooling (what SimCSE trains, llm2vec's default), llm2vec's default inference lengths, instructions not pooled.
LLM2VEC_CONFIG = {"pooling_mode": "mean", "max_length": 512, "doc_max_length": 400, "skip_instruction": True}


def _save_adapter(model, out: Path, lora: LoraSpec, *, bare: bool = True, base: hub.Source | None = None) -> None:
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
    """``_save_adapter``'s files, written into ``tmp`` and then moved into ``out``."""
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


def _save_checkpoint(ckpt: Path, model, opt, sched, step: int, rows: list[dict], lora: LoraSpec) -> None:
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
    _write_log(rows, ckpt.parent / LOG_FILE)


def _write_log(rows: list[dict], path: Path) -> None:
    """The training log (one row per step) written whole."""
    import pandas as pd

    atomic_write(path, pd.DataFrame(rows).to_csv(index=False).encode("utf-8"), RESUME_FIX)


def _load_checkpoint(ckpt: Path, model, opt, sched) -> tuple[int, list[dict]]:
    import pandas as pd
    from safetensors.torch import load_file

    peft().set_peft_model_state_dict(model, load_file(str(ckpt / "adapter_model.safetensors")))
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    rows = pd.read_csv(ckpt / LOG_FILE).to_dict("records")
    return int(state["step"]), rows


def _plot_loss(log, path: Path, objective: str) -> None:
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


def _texts_hash(texts: Sequence[str]) -> str:
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
