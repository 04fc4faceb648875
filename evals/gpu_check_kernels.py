"""The kernel sections of ``evals/gpu_check.py``: ``check_attention``, ``check_pooling``, ``check_norms`` and
``check_rotary``, each kernel of ``lab.kernels`` at real sizes against its torch reference and the float32 oracle in
each dtype, then timed beside the reference (attention also beside SDPA's flash backend and flash-attn; rotary
beside the ``pairs`` layout's rotation)."""

from __future__ import annotations

import functools

from evals.gpu_check_harness import Check, cu_of, lengths_for, max_abs, max_err


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
