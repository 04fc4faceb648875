"""The harness of ``evals/gpu_check.py``'s sections: ``Check`` (the rows of the CSV, ``COLUMNS`` in order, the
timings with ``triton.testing.do_bench``, the accuracy rows against ``lab.kernels.tolerances``, and the failures)
and the helpers the kernel sections share (``max_err``, ``max_abs``, ragged lengths and their offsets)."""

from __future__ import annotations

import contextlib
import time
import traceback
from datetime import datetime, timezone

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
