"""One prepared GPU check: the Triton kernels at real sizes, their speed against torch, and the engine against
sentence-transformers. Meant for a CUDA machine (about 3-5 minutes on one H100/H200; a budget guard stops at 7).

1. correctness in bf16 and fp16, with the tolerances of ``lab.kernels.tolerances`` (the table the kernel tests
   use): each kernel's max error against the float32 oracle must be at most 2x the plain torch reference's error
   in the same dtype, plus the table's atol as a floor (pooling: against the reference on the same input, both
   accumulate in float32, within the table's atol + rtol * max |reference|);
2. timings with ``triton.testing.do_bench`` (p20 / p50 / p80 ms): each kernel vs its torch reference, attention
   also vs ``scaled_dot_product_attention`` on the flash backend over a padded batch (timing only) and vs
   ``flash_attn_varlen_func`` when flash-attn is installed;
3. ``lab.Engine(...).embed`` (triton and torch backends) vs ``SentenceTransformer.encode`` on the same texts
   (STSBenchmark sentences from ``evals/data/stsbenchmark`` when present), with the embeddings' cosine agreement;
4. a random Llama-family decoder through the engine (both attention backends) against transformers on the GPU
   (``check_decoder``); the rotary section also checks and times the ``pairs`` layout's rotation
   (``lab.models.rope.rotate_pairs_``, a CPU engine's choice) beside the Triton kernel.

Writes tidy rows (one per section / kernel / provider / config / dtype / metric, with the run's ``run_date``) to a
CSV, the command in ``<csv>.meta.json``, and prints a table; exits 1 if a correctness check fails or a section
raised. The default CSV is ``evals/results/gpu_check/gpu_check_<machine>.csv``, the machine the GPU's short name
(``evals.results_index.gpu_slug``: ``h200``), or the CPU's under ``--smoke``; the printed output, kept, goes beside it
as ``gpu_check_<machine>.log``, and the kernel tests' output as ``kernel_tests_<machine>.log``.

    python evals/gpu_check.py                           # -> evals/results/gpu_check/gpu_check_<machine>.csv
    python evals/gpu_check.py /tmp/out.csv --skip-engine
    python evals/gpu_check.py --smoke                   # CPU + Triton interpreter, tiny shapes: checks the script

On a machine where the project cannot be installed (a lent GPU box with its own torch and no package index), run it
from the checkout: ``ln -s ../kernels lab/kernels`` (the mapping the installed package makes), then
``PYTHONPATH=. python3 evals/gpu_check.py --model <a copy of all-MiniLM-L6-v2>``; that is how
``evals/results/gpu_check/gpu_check_h200.csv`` was made (README).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import os
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evals" / "results" / "gpu_check"
COLUMNS = [
    "section",
    "kernel",
    "provider",
    "config",
    "dtype",
    "metric",
    "value",
    "p20",
    "p50",
    "p80",
    "baseline",
    "speedup",
    "bound",
    "ok",
    "device",
    "torch",
    "triton",
    "when",
    "run_date",
]


class Check:
    """Collects rows, times callables, and remembers failures."""

    def __init__(self, device: str, smoke: bool, budget_s: float):
        import torch

        self.torch = torch
        self.device = device
        self.smoke = smoke
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[dict] = []
        self.failed = False
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = ""
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke run)"
        now = datetime.now(timezone.utc)
        self.common = {
            "device": name,
            "torch": torch.__version__,
            "triton": triton_version,
            "when": now.isoformat(timespec="seconds"),
            "run_date": now.date().isoformat(),
        }

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def add(self, **row) -> dict:
        row = {**{c: "" for c in COLUMNS}, **self.common, **row}
        for k in ("value", "p20", "p50", "p80", "speedup", "bound"):
            if isinstance(row[k], float):
                row[k] = f"{row[k]:.6g}"
        if row["ok"] is False:
            self.failed = True
        self.rows.append(row)
        return row

    @contextlib.contextmanager
    def guard(self, section: str, what: str):
        """Record an exception as a failed row and go on: one broken check must not lose a scarce GPU run."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            traceback.print_exception(exc)
            self.add(section=section, kernel=what, metric="error", value=repr(exc)[:300], ok=False)

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def bench(self, fn) -> tuple[float, float, float]:
        """(p20, p50, p80) milliseconds."""
        if self.device == "cuda":
            import triton.testing

            p20, p50, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
            return p20, p50, p80
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        return times[0], times[1], times[2]

    def accuracy(self, section, kernel, config, dtype, err_kernel, err_torch=None, scale=0.0):
        """Rows for the torch reference's error and the kernel's, with the kernel's pass/fail.

        The bound is ``lab.kernels.tolerances.error_bound``: ``2 * err_torch + atol`` when ``err_torch`` (the torch
        reference's error against the float32 oracle) is given, else ``atol + rtol * scale`` (direct comparison,
        ``scale`` = max |reference|).
        """
        from lab.kernels.tolerances import error_bound

        dname = str(dtype).replace("torch.", "")
        bound = error_bound(kernel, dtype, err_torch, scale=scale)
        ok = bool(err_kernel <= bound)
        if err_torch is not None:
            self.add(
                section=section,
                kernel=kernel,
                provider="torch",
                config=config,
                dtype=dname,
                metric="max_abs_err",
                value=float(err_torch),
            )
        return self.add(
            section=section,
            kernel=kernel,
            provider="triton",
            config=config,
            dtype=dname,
            metric="max_abs_err",
            value=float(err_kernel),
            bound=float(bound),
            ok=ok,
        )

    def timings(self, section, kernel, config, dtype, providers: dict) -> None:
        """Time each provider; ``torch`` (the reference) is the baseline of the speedup column."""
        dname = str(dtype).replace("torch.", "")
        results = {}
        for provider, fn in providers.items():
            try:
                results[provider] = self.bench(fn)
            except Exception as exc:  # noqa: BLE001  (an optional baseline that cannot run here is recorded)
                self.add(
                    section=section,
                    kernel=kernel,
                    provider=provider,
                    config=config,
                    dtype=dname,
                    metric="skipped",
                    value=repr(exc)[:200],
                )
        base = results.get("torch")
        for provider, (p20, p50, p80) in results.items():
            self.add(
                section=section,
                kernel=kernel,
                provider=provider,
                config=config,
                dtype=dname,
                metric="ms",
                value=p50,
                p20=p20,
                p50=p50,
                p80=p80,
                baseline="torch" if base else "",
                speedup=base[1] / p50 if base and p50 > 0 else "",
            )


def max_err(a, b) -> float:
    """Max |a - b| over finite entries; inf when the non-finite entries (max pooling of an empty span) differ."""
    a, b = a.float(), b.float()
    fa, fb = a.isfinite(), b.isfinite()
    if not bool((fa == fb).all()) or not bool((a[~fa].nan_to_num(0) == b[~fb].nan_to_num(0)).all()):
        return float("inf")
    return (a[fa] - b[fb]).abs().max().item() if bool(fa.any()) else 0.0


def max_abs(t) -> float:
    """Max |t| over finite entries (0 when none): the scale of a direct comparison's rtol."""
    t = t.float()
    t = t[t.isfinite()]
    return t.abs().max().item() if t.numel() else 0.0


def lengths_for(torch, gen, b: int, max_len: int) -> list[int]:
    """Ragged lengths in 1..max_len with a length-1 and a max-length sequence."""
    lengths = torch.randint(1, max_len + 1, (b,), generator=gen).tolist()
    lengths[0] = 1
    lengths[-1] = max_len
    return lengths


def cu_of(torch, lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------------- attention
def _sdpa_flash(q, k, v, causal):
    """SDPA restricted to the flash backend (padded (B, H, L, D) inputs)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check_attention(ck: Check, dtypes) -> None:
    torch = ck.torch
    from lab.kernels import attention as ka
    from lab.kernels import reference as ref

    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    # name, batch, max_len, Hq, Hkv, D, causal, max_prefix
    configs = [
        ("bert-base bidir", 64, 256, 12, 12, 64, False, 0),
        ("llama-8b causal gqa", 16, 1024, 32, 8, 128, True, 0),
        ("qwen causal gqa prefix", 16, 512, 16, 2, 128, True, 256),
        ("d80 bidir", 32, 384, 16, 16, 80, False, 0),
        ("d96 causal", 32, 384, 32, 32, 96, True, 0),
    ]
    if ck.smoke:
        configs = [(n, 3, 20, min(hq, 4), min(hkv, 2), d, c, min(p, 8)) for n, _, _, hq, hkv, d, c, p in configs[:3]]
    gen = torch.Generator().manual_seed(0)
    dev = ck.device
    for name, b, max_len, hq, hkv, d, causal, max_prefix in configs:
        if ck.over_budget():
            ck.add(section="attention", kernel="varlen_attention", config=name, metric="skipped", value="budget")
            continue
        lengths = lengths_for(torch, gen, b, max_len)
        prefix = torch.randint(0, max_prefix + 1, (b,), generator=gen).tolist() if max_prefix else None
        config = f"{name}: B={b} T={sum(lengths)} max={max_len} Hq={hq} Hkv={hkv} D={d}" + (
            f" prefix={sum(prefix)}" if prefix else ""
        )
        cu = cu_of(torch, lengths, dev)
        for dtype in dtypes:
            with ck.guard("attention", f"varlen_attention {config} {dtype}"):
                total = sum(lengths)
                q = torch.randn(total, hq, d, device=dev, dtype=dtype)
                k = torch.randn(total, hkv, d, device=dev, dtype=dtype)
                v = torch.randn(total, hkv, d, device=dev, dtype=dtype)
                kw, kw32 = {}, {}
                if prefix:
                    kp = torch.randn(sum(prefix), hkv, d, device=dev, dtype=dtype)
                    vp = torch.randn(sum(prefix), hkv, d, device=dev, dtype=dtype)
                    cp = cu_of(torch, prefix, dev)
                    kw = {"k_prefix": kp, "v_prefix": vp, "cu_prefix": cp}
                    kw32 = {"k_prefix": kp.float(), "v_prefix": vp.float(), "cu_prefix": cp}
                exact = ref.varlen_attention_naive(q.float(), k.float(), v.float(), cu, causal=causal, **kw32)
                run_ref = functools.partial(
                    ref.varlen_attention,
                    q,
                    k,
                    v,
                    cu,
                    max_len,
                    causal=causal,
                    seqlens=lengths,
                    prefix_lens=prefix,
                    **kw,
                )
                run_tri = functools.partial(ka.varlen_attention, q, k, v, cu, max_len, causal=causal, **kw)
                err_torch = max_err(run_ref(), exact)
                out = run_tri()
                ck.sync()
                ck.accuracy("attention", "varlen_attention", config, dtype, max_err(out, exact), err_torch)
                del exact, out
                providers = {"triton": run_tri, "torch": run_ref}
                # padded batch on SDPA's flash backend: timing only (padding keys are not masked)
                pad_k = max_len + (max(prefix) if prefix else 0)
                qp = torch.randn(b, hq, max_len, d, device=dev, dtype=dtype)
                kpad = torch.randn(b, hq, pad_k, d, device=dev, dtype=dtype)
                vpad = torch.randn(b, hq, pad_k, d, device=dev, dtype=dtype)

                providers["sdpa_flash_padded"] = functools.partial(_sdpa_flash, qp, kpad, vpad, causal)
                if flash_attn_varlen_func is not None and not prefix and dev == "cuda":
                    providers["flash_attn_varlen"] = functools.partial(
                        flash_attn_varlen_func, q, k, v, cu, cu, max_len, max_len, causal=causal
                    )
                ck.timings("attention", "varlen_attention", config, dtype, providers)
                del qp, kpad, vpad


# ----------------------------------------------------------------------------------------------------- pooling
def check_pooling(ck: Check, dtypes) -> None:
    torch = ck.torch
    from lab.kernels import pooling as kp
    from lab.kernels import reference as ref

    gen = torch.Generator().manual_seed(1)
    b, max_len, sizes = (128, 512, (1024, 4096)) if not ck.smoke else (4, 40, (48,))
    lengths = lengths_for(torch, gen, b, max_len)
    cu = cu_of(torch, lengths, ck.device)
    pool_start = torch.randint(0, 8, (b,), generator=gen).to(ck.device)
    for h in sizes:
        for dtype in dtypes:
            hidden = torch.randn(sum(lengths), h, device=ck.device, dtype=dtype)
            for method in ("cls", "mean", "lasttoken", "weightedmean", "max"):
                config = f"B={b} T={sum(lengths)} H={h} {method} pool_start"
                with ck.guard("pooling", f"segment_pool {config} {dtype}"):
                    kw = {"pool_start": pool_start}
                    want = ref.segment_pool(hidden, cu, method, **kw)
                    got = kp.segment_pool(hidden, cu, method, **kw)
                    ck.accuracy("pooling", "segment_pool", config, dtype, max_err(got, want), scale=max_abs(want))
                    if method in ("mean", "lasttoken") and not ck.over_budget():
                        ck.timings(
                            "pooling",
                            "segment_pool",
                            config,
                            dtype,
                            {
                                "triton": functools.partial(kp.segment_pool, hidden, cu, method, **kw),
                                "torch": functools.partial(ref.segment_pool, hidden, cu, method, **kw),
                            },
                        )


# ------------------------------------------------------------------------------------------------------- norms
def check_norms(ck: Check, dtypes) -> None:
    torch = ck.torch
    from lab.kernels import norms as kn
    from lab.kernels import reference as ref

    rows, widths = (16384, (768, 4096)) if not ck.smoke else (5, (48, 123))
    for n in widths:
        for dtype in dtypes:
            config = f"T={rows} H={n} +residual"
            with ck.guard("norms", f"{config} {dtype}"):
                x = torch.randn(rows, n, device=ck.device, dtype=dtype)
                r = torch.randn(rows, n, device=ck.device, dtype=dtype)
                w = (1 + 0.1 * torch.randn(n, device=ck.device)).to(dtype)
                bias = (0.1 * torch.randn(n, device=ck.device)).to(dtype)
                exact = ref.add_layer_norm(x.float(), r.float(), w.float(), bias.float(), 1e-12)
                err_torch = max_err(ref.add_layer_norm(x, r, w, bias, 1e-12), exact)
                ck.accuracy(
                    "norms",
                    "add_layer_norm",
                    config,
                    dtype,
                    max_err(kn.add_layer_norm(x, r, w, bias, 1e-12), exact),
                    err_torch,
                )
                exact, _ = ref.add_rms_norm(x.float(), r.float(), w.float(), 1e-6)
                err_torch = max_err(ref.add_rms_norm(x, r, w, 1e-6)[0], exact)
                ck.accuracy(
                    "norms",
                    "add_rms_norm",
                    config,
                    dtype,
                    max_err(kn.add_rms_norm(x, r, w, 1e-6)[0], exact),
                    err_torch,
                )
                if not ck.over_budget():
                    ck.timings(
                        "norms",
                        "add_layer_norm",
                        config,
                        dtype,
                        {
                            "triton": functools.partial(kn.add_layer_norm, x, r, w, bias, 1e-12),
                            "torch": functools.partial(ref.add_layer_norm, x, r, w, bias, 1e-12),
                        },
                    )
                    ck.timings(
                        "norms",
                        "add_rms_norm",
                        config,
                        dtype,
                        {
                            "triton": functools.partial(kn.add_rms_norm, x, r, w, 1e-6),
                            "torch": functools.partial(ref.add_rms_norm, x, r, w, 1e-6),
                        },
                    )


# ------------------------------------------------------------------------------------------------------ rotary
def check_rotary(ck: Check, dtypes) -> None:
    torch = ck.torch
    from lab.kernels import reference as ref
    from lab.kernels import rotary as kr
    from lab.kernels.tolerances import error_bound

    from lab.models.rope import pairs_order, rotate_pairs_

    t, shapes = (16384, ((32, 128), (8, 128), (16, 80))) if not ck.smoke else (6, ((3, 32), (2, 48)))
    for h, d in shapes:
        positions = torch.randint(0, 8192, (t,), device=ck.device)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=ck.device).float() / d)
        cos, sin = ref.rotary_cos_sin(positions, inv_freq)
        for dtype in dtypes:
            config = f"T={t} H={h} D={d}"
            with ck.guard("rotary", f"{config} {dtype}"):
                x = torch.randn(t, h, d, device=ck.device, dtype=dtype)
                exact = ref.apply_rotary(x.float(), cos, sin)
                err_torch = max_err(ref.apply_rotary(x.clone(), cos, sin), exact)
                ck.accuracy(
                    "rotary",
                    "apply_rotary",
                    config,
                    dtype,
                    max_err(kr.apply_rotary(x.clone(), cos, sin), exact),
                    err_torch,
                )
                # the ``pairs`` head layout (``lab.models.rope``; a decoder loaded on CPU keeps it on the GPU)
                order = pairs_order(d).to(ck.device)
                xp, cis = x[..., order].contiguous(), torch.complex(cos, sin)
                err_pairs = max_err(rotate_pairs_(xp.clone(), cis), exact[..., order])
                bound = error_bound("apply_rotary", dtype, err_torch)
                ck.add(
                    section="rotary",
                    kernel="rotate_pairs_",
                    provider="torch_pairs",
                    config=config,
                    dtype=str(dtype).replace("torch.", ""),
                    metric="max_abs_err",
                    value=float(err_pairs),
                    bound=float(bound),
                    ok=bool(err_pairs <= bound),
                )
                if not ck.over_budget():
                    ck.timings(
                        "rotary",
                        "apply_rotary",
                        config,
                        dtype,
                        {
                            "triton": functools.partial(kr.apply_rotary, x, cos, sin),
                            "torch_pairs": functools.partial(rotate_pairs_, xp, cis),
                            "torch": functools.partial(ref.apply_rotary, x, cos, sin),
                        },
                    )


# ------------------------------------------------------------------------------------------------------ engine
def load_texts(n: int) -> tuple[list[str], str]:
    """STSBenchmark test sentences (repeated up to ``n``), else synthetic sentences of varied length."""
    path = REPO / "evals" / "data" / "stsbenchmark" / "test.jsonl.gz"
    texts, source = [], "synthetic"
    if path.exists():
        from evals.data_io import read_jsonl  # the repository is on sys.path by now (main)

        texts = [s for rec in read_jsonl(path) for s in (rec["sentence1"], rec["sentence2"])]
        source = f"stsbenchmark test ({len(texts)} sentences)"
    if not texts:
        words = [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "researchers",
            "measure",
            "prefill",
            "throughput",
        ]
        texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 40)) for i in range(2000)]
    out = (texts * (n // len(texts) + 1))[:n]
    return out, source


def check_engine(ck: Check, n_texts: int, st_batch: int, model: str | None = None) -> None:
    torch = ck.torch
    import numpy as np

    from lab import Engine

    path = model
    if path is None:
        from lab._extras import minilm_path

        path = minilm_path()
    from lab.models.hub import local_folder

    path = local_folder(path)  # a hub id: its snapshot folder (sentence-transformers loads the same files)
    texts, source = load_texts(n_texts)
    dtype = "bfloat16" if ck.device == "cuda" else "float32"
    config = f"{'all-MiniLM-L6-v2' if model is None else Path(path).name}, {len(texts)} texts from {source}"
    runs = 3 if not ck.smoke else 1
    results, embs = {}, {}

    def timed(provider, fn):
        fn(texts[: min(256, len(texts))])  # warm-up: compile kernels, allocator, tokenizer caches
        ck.sync()
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            emb = fn(texts)
            ck.sync()
            times.append(time.perf_counter() - t)
        results[provider] = statistics.median(times)
        embs[provider] = np.asarray(emb, dtype=np.float32)

    for backend in ("triton", "torch"):
        with ck.guard("engine", f"Engine attention_backend={backend}"):
            eng = Engine(path, dtype=dtype, device=ck.device, attention_backend=backend)
            timed(f"engine_{backend}", eng.embed)
            del eng
    with ck.guard("engine", "SentenceTransformer.encode"):
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device=ck.device)
        st.to(getattr(torch, dtype))
        timed("sentence_transformers", functools.partial(st.encode, batch_size=st_batch, convert_to_numpy=True))

    base = results.get("sentence_transformers")
    for provider, secs in results.items():
        ck.add(
            section="engine",
            kernel="embed",
            provider=provider,
            config=config,
            dtype=dtype,
            metric="s",
            value=secs,
            p50=secs,
            baseline="sentence_transformers" if base else "",
            speedup=base / secs if base else "",
        )
        ck.add(
            section="engine",
            kernel="embed",
            provider=provider,
            config=config,
            dtype=dtype,
            metric="texts_per_s",
            value=len(texts) / secs,
        )
    if "sentence_transformers" in embs:
        ref_emb = embs["sentence_transformers"]
        ref_emb = ref_emb / np.linalg.norm(ref_emb, axis=1, keepdims=True).clip(1e-12)
        for provider in ("engine_triton", "engine_torch"):
            if provider in embs:
                e = embs[provider] / np.linalg.norm(embs[provider], axis=1, keepdims=True).clip(1e-12)
                cos = (e * ref_emb).sum(1)
                bound = 0.99 if dtype == "bfloat16" else 0.9999
                ck.add(
                    section="engine",
                    kernel="embed",
                    provider=provider,
                    config=config,
                    dtype=dtype,
                    metric="min_cosine_vs_st",
                    value=float(cos.min()),
                    bound=bound,
                    ok=bool(cos.min() >= bound),
                )


# ----------------------------------------------------------------------------------------------------- decoder
def check_decoder(ck: Check, tokenizer_from: str | None) -> None:
    """A random Llama (grouped-query attention, head size 64, 4 layers) through the engine on the GPU, both attention
    backends, mean pooling, against transformers' float32 forward on the same device, in float32 and bfloat16, on
    short sentences and a few joined ones (~200 tokens). The tokenizer is all-MiniLM-L6-v2's (any works for random
    weights). (The ``pairs`` rotary layout is a CPU choice made at load; the rotary section checks its rotation.)"""
    torch = ck.torch
    import tempfile

    import numpy as np
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from evals.criteria import min_cosine  # the repository is on sys.path by now (main)
    from lab import Engine

    if tokenizer_from is None:
        from lab._extras import minilm_path

        tokenizer_from = minilm_path()
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    small = ck.smoke
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64 if small else 512,
        intermediate_size=96 if small else 1408,
        num_hidden_layers=2 if small else 4,
        num_attention_heads=4 if small else 8,
        num_key_value_heads=2,
        head_dim=16 if small else 64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    folder = Path(tempfile.mkdtemp()) / "llama-random"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    sentences, _ = load_texts(8 if small else 96)
    texts = sentences + [" ".join(sentences[i : i + 24]) for i in range(0, len(sentences) - 23, 24)]
    reference = model.model.to(ck.device)
    config = (
        f"random Llama h={cfg.hidden_size} L={cfg.num_hidden_layers} Hq={cfg.num_attention_heads} "
        f"Hkv={cfg.num_key_value_heads} D={cfg.head_dim}, {len(texts)} texts"
    )
    want = None
    for dtype in ("float32",) if small else ("float32", "bfloat16"):  # the interpreter lacks bfloat16 math
        for backend in ("triton", "torch"):
            with ck.guard("decoder", f"Engine on {ck.device}, {backend}, {dtype}"):
                eng = Engine(str(folder), pooling="mean", dtype=dtype, device=ck.device, attention_backend=backend)
                requests = eng.tokenize(texts)
                if want is None:  # the float32 reference, one text at a time, mean over its tokens
                    with torch.no_grad():
                        want = np.stack(
                            [
                                reference(input_ids=torch.tensor([list(r.ids)], device=ck.device))
                                .last_hidden_state[0]
                                .mean(0)
                                .float()
                                .cpu()
                                .numpy()
                                for r in requests
                            ]
                        )
                cos = min_cosine(eng.embed(texts), want)
                bound = 0.9999 if dtype == "float32" else 0.99
                ck.add(
                    section="decoder",
                    kernel="embed",
                    provider=f"engine_{backend}",
                    config=config,
                    dtype=dtype,
                    metric="min_cosine_vs_transformers",
                    value=cos,
                    bound=bound,
                    ok=bool(cos >= bound),
                )
                ck.add(
                    section="decoder",
                    kernel="embed",
                    provider=f"engine_{backend}",
                    config=config,
                    dtype=dtype,
                    metric="longest_tokens",
                    value=float(max(r.length for r in requests)),
                )


# -------------------------------------------------------------------------------------------------------- main
def csv_text(rows: list[dict]) -> str:
    """The rows as CSV, ``COLUMNS`` in order."""
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    return text.getvalue()


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'section':<9} {'kernel':<16} {'provider':<22} {'dtype':<8} {'metric':<16} {'value':>11} "
        f"{'speedup':>8} {'ok':>5}  config"
    )
    for r in rows:
        ok = "" if r["ok"] == "" else ("PASS" if r["ok"] else "FAIL")
        speed = f"{float(r['speedup']):.2f}x" if r["speedup"] not in ("", None) else ""
        print(
            f"{r['section']:<9} {r['kernel'][:16]:<16} {r['provider'][:22]:<22} {r['dtype']:<8} "
            f"{r['metric'][:16]:<16} {str(r['value'])[:11]:>11} {speed:>8} {ok:>5}  {r['config'][:70]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "csv", nargs="?", default=None, help="output CSV (default evals/results/gpu_check/gpu_check_<machine>.csv)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU + TRITON_INTERPRET=1, tiny shapes: exercises this script without a GPU",
    )
    parser.add_argument("--skip-engine", action="store_true", help="kernels only (no engine or decoder section)")
    parser.add_argument("--engine-texts", type=int, default=10000, help="texts per engine timing run")
    parser.add_argument("--st-batch-size", type=int, default=128, help="SentenceTransformer.encode batch size")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip further timings after this long")
    parser.add_argument(
        "--model",
        default=None,
        help="all-MiniLM-L6-v2 folder or hub id for the engine section (default: the bundled "
        "package's; a "
        "machine without that package, such as a lent GPU box, gets a copy)",
    )
    args = parser.parse_args(argv)

    if args.smoke:  # must precede the first `import triton` (sentence-transformers imports it too)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "evals/gpu_check.py needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Run it on a CUDA machine, or use "
            "--smoke for a CPU dry run of the script under the Triton interpreter.",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(REPO))
    from evals.results_index import device_slug, save_table

    device = "cpu" if args.smoke else "cuda"
    if args.csv is None:
        args.csv = str(RESULTS / f"gpu_check_{device_slug(device)}.csv")
    ck = Check(device, args.smoke, args.budget_s)
    dtypes = [torch.float16] if args.smoke else [torch.bfloat16, torch.float16]  # the interpreter lacks bf16 math
    torch.manual_seed(0)
    steps = [
        ("attention", lambda: check_attention(ck, dtypes)),
        ("pooling", lambda: check_pooling(ck, dtypes)),
        ("norms", lambda: check_norms(ck, dtypes)),
        ("rotary", lambda: check_rotary(ck, dtypes)),
    ]
    if not args.skip_engine:
        n = 8 if args.smoke else args.engine_texts
        steps.append(("engine", lambda: check_engine(ck, n, args.st_batch_size, args.model)))
        steps.append(("decoder", lambda: check_decoder(ck, args.model)))
    try:
        for name, step in steps:
            t = time.perf_counter()
            print(f"[{time.perf_counter() - ck.t0:6.1f}s] {name} ...", flush=True)
            with ck.guard(name, name):
                step()
            print(f"[{time.perf_counter() - ck.t0:6.1f}s] {name} done in {time.perf_counter() - t:.1f}s", flush=True)
    finally:
        save_table(Path(args.csv), csv_text(ck.rows))
    print_table(ck.rows)
    print(
        f"\nwrote {len(ck.rows)} rows to {args.csv} in {time.perf_counter() - ck.t0:.0f}s; "
        f"{'SOME CHECKS FAILED' if ck.failed else 'all correctness checks passed'}"
    )
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
