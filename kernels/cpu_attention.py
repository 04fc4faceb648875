"""prefill-lab's own CPU attention kernel (``cpu_attention.c``; built into one library with the row kernels of
``cpu_rows.c``, both on ``cpu_vector.h``), compiled on the running machine and called through ctypes: varlen,
bidirectional or causal, grouped-query heads, float32 or bfloat16 in, float32 arithmetic.

torch's fused CPU kernel runs MiniLM's 32-wide heads at well under its GEMM rate; this one stages each sequence's
K^T and V once and computes exact softmax rows over blocks of 8 queries (4 without AVX-512) with the block's scores
accumulated in registers. It is one candidate of
the ``attention_kernel`` probe (``lab.ops.probes``), never a default chosen by CPU flags: where it is slower, or
cannot be built (no C compiler), the probe does not pick it.

The library is built once per machine with the first C compiler found (``$CC``, ``cc``, ``gcc``, ``clang``) at
``-O3 -march=native`` and cached under ``$LAB_KERNEL_CACHE`` (default ``~/.cache/prefill-lab/kernels``), keyed by
the source, the compiler and the CPU's flags, so a cache shared between machines never hands one CPU another's
build. ``available()`` says whether it loaded and, if not, why (``unavailable_reason()``). ``use_build`` runs
every caller in the process on another build for the length of a block (the tests run the engine on the portable
and AVX2 builds through it).

    >>> if available():
    ...     out = varlen_attention(q, k, v, cu_seqlens, causal=False)   # q (T, Hq, D), k/v (T, Hkv, D)
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from . import env

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.c", "cpu_rows.c"))  # one library
HEADERS = (Path(__file__).with_name("cpu_vector.h"),)  # the vector helpers both include
WIDTH = 16  # floats per vector in the kernel: the head size must be a multiple of it
DTYPES = (torch.float32, torch.bfloat16)

_LIB: ctypes.CDLL | None = None
_REASON: str | None = None
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """``$LAB_KERNEL_CACHE`` (a folder; a file in its place is a ``ValueError`` naming the variable), else
    ``~/.cache/prefill-lab/kernels``."""
    return env.path("LAB_KERNEL_CACHE", Path.home() / ".cache" / "prefill-lab" / "kernels", folder=True)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build(cc: str | None = None, arch: list[str] | None = None, directory: Path | None = None) -> Path:
    """Compile ``cpu_attention.c`` and ``cpu_rows.c`` into one library (once: the result is cached by the sources,
    compiler, CPU flags and ``arch``) and return its path. ``arch``: the target flags; default ``-march=native``
    (``-mcpu=native`` where the compiler spells it so, nothing where neither works). ``directory``: default
    ``cache_dir()``."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    tries = [arch] if arch is not None else [["-march=native"], ["-mcpu=native"], []]
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_flags().encode(), repr(tries).encode()]))
    target = Path(directory or cache_dir()) / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in tries:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [
                cc,
                "-O3",
                *flags,
                "-fPIC",
                "-shared",
                "-std=gnu11",
                "-Wno-psabi",
                "-Werror=implicit-function-declaration",
                "-I",
                str(SOURCES[0].parent),
                "-o",
                str(out),
                *map(str, SOURCES),
                "-lm",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if r.returncode == 0:
                os.replace(out, target)  # atomic: a concurrent build of the same key just overwrites it
                return target
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
    raise RuntimeError("compiling lab.kernels.cpu_attention failed:\n" + "\n".join(errors))


def _load() -> ctypes.CDLL | None:
    global _LIB, _REASON
    # every layer of every step asks: no lock once the outcome is known, loaded or not (so a lock an interrupt left
    # held on its ``with`` line's exit, see lab.ops.probes._LOCK, stalls no worker)
    if _LIB is not None or _REASON is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None or _REASON is not None:
            return _LIB
        if not env.flag("LAB_CPU_NATIVE_KERNELS", True):  # a value it does not take raises, naming it
            _REASON = f"disabled by {env.setting('LAB_CPU_NATIVE_KERNELS')}"
            return None
        try:
            lib = bind(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _REASON = str(e)
            return None
        _LIB = lib
        return lib


def bind(path: str | os.PathLike) -> ctypes.CDLL:
    """Load a build of the kernels (``build``) and declare its functions' signatures."""
    lib = ctypes.CDLL(str(path))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.lab_varlen_attention.restype = i32
    lib.lab_varlen_attention.argtypes = [
        i32,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i32,
        i32,
        i32,
        ctypes.c_float,
        i32,
    ]
    lib.lab_attention_native_bf16.restype = i32
    lib.lab_attention_native_bf16.argtypes = []
    lib.lab_add_layer_norm.restype = i32  # lab.kernels.cpu_norms
    lib.lab_add_layer_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32, ctypes.c_float]
    lib.lab_add_rms_norm.restype = i32
    lib.lab_add_rms_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i32, ctypes.c_float]
    lib.lab_rope_pairs.restype = i32  # lab.kernels.cpu_rope
    lib.lab_rope_pairs.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, i32, i32]
    return lib


@contextlib.contextmanager
def use_build(lib: ctypes.CDLL) -> Iterator[ctypes.CDLL]:
    """Inside the block, every caller that takes this machine's build (the engine's layers and probes,
    ``cpu_norms``, ``cpu_rope``, ``available()``) gets ``lib`` instead: another build of the kernels
    (``bind(build(arch=[]))``, the portable one; ``arch=["-mavx2", "-mfma"]``, an AVX2 machine's), or any object with
    its functions. The build in force before (or the reason there was none) comes back after the block. It swaps
    the process's library: use it while no other thread runs these kernels.

        >>> with use_build(bind(build(arch=[]))):
        ...     Engine(path, cpu_paths={"attention_kernel": "lab"}).embed(texts)
    """
    global _LIB, _REASON
    _load()
    with _LOCK:
        saved = _LIB, _REASON
        _LIB, _REASON = lib, None
    try:
        yield lib
    finally:
        with _LOCK:
            _LIB, _REASON = saved


def native_bf16() -> bool:
    """Whether bfloat16 inputs use the CPU's bfloat16 dot products (AVX512-BF16) rather than widening."""
    lib = _load()
    return bool(lib is not None and lib.lab_attention_native_bf16())


def available() -> bool:
    """Whether the kernel is built and loaded on this machine (builds it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True or was not asked yet)."""
    _load()
    return _REASON


def library(lib: ctypes.CDLL | None = None, module: str = "lab.kernels.cpu_attention") -> ctypes.CDLL:
    """``lib`` (a build other than this machine's, ``bind``) or this machine's build; a ``RuntimeError`` naming
    ``module`` (the caller: this module, ``cpu_norms``, ``cpu_rope``) and the reason when there is none."""
    lib = lib or _load()
    if lib is None:
        raise RuntimeError(f"{module} is not available: {_REASON}")
    return lib


def chosen(choice: str | None, backend: str) -> bool:
    """Whether a layer runs one of this library's kernels for a step its probe decided: the probe's ``choice`` is
    ``lab``, the ``backend`` is not Triton (which keeps its own kernels), and nothing records gradients (these
    kernels have no backward: training, e.g. ``lab.adapt``, runs torch's ops)."""
    return (
        choice == "lab" and backend != "triton" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    )


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs: CPU float32 / bfloat16, head size a multiple of ``WIDTH``, query
    heads a multiple of key/value heads."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.shape[-1] % WIDTH == 0
        and q.shape[1] % k.shape[1] == 0
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    softmax_scale: float | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence: q ``(T, Hq, D)``, k/v ``(T, Hkv, D)`` (any token / head strides, D
    contiguous), ``cu_seqlens`` ``(B + 1,)`` -> ``(T, Hq, D)`` in q's dtype. Runs on the calling thread. ``lib``: a
    build other than this machine's (``bind``; the tests run the portable builds through it)."""
    lib = library(lib)
    if not supports(q, k) or v.dtype != q.dtype or v.shape != k.shape:
        raise ValueError(
            f"cpu_attention takes CPU float32/bfloat16 q (T, Hq, D), k/v (T, Hkv, D) with D a multiple "
            f"of {WIDTH} and Hq a multiple of Hkv; got q {tuple(q.shape)} {q.dtype}, k "
            f"{tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype} on {q.device}"
        )
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the {q.shape[0]} packed tokens; got {cu.tolist()[:8]}...")
    out = torch.empty(q.shape, dtype=q.dtype)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    rc = lib.lab_varlen_attention(
        int(q.dtype == torch.bfloat16),
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        cu.data_ptr(),
        cu.numel() - 1,
        hq,
        hkv,
        d,
        scale,
        int(causal),
    )
    if rc == 2:
        raise MemoryError("cpu_attention could not allocate its scratch for the longest sequence")
    if rc:
        raise ValueError(f"cpu_attention rejected the shapes (code {rc})")
    return out
