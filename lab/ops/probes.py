"""CPU fast paths chosen by measurement on the running machine, not by CPU flags.

Machines of one kind differ: oneDNN's native bfloat16 GEMMs run well below the float32 rate on some AVX-512 CPUs (an
Intel Xeon without AVX512-BF16) and well above it on others (AVX512-BF16; no AMX on any; measured: evals/README.md,
"Measurements behind the code's choices"). So every CPU
fast-path choice a model family makes (its ``cpu_probes``, read back from ``model.plan``) is decided by a short
probe: the candidate implementations of that step run on random tensors of the model's shapes, interleaved, in the
thread layout the engine runs them in (one intra-op thread per CPU worker), each best of ``REPEATS`` after
``WARMUP`` untimed calls, and the fastest wins (the first candidate, the default, unless another is at least
``MARGIN`` faster: ``choose``). A measurement is made once per process, shape class, thread layout and the choices
made before it (``context``), and cached: it is a fact about this machine, and the choice each engine takes from it
goes into that engine's own plan (``lab.ops.plan.CpuPlan``). A choice can be forced per engine
(``Engine(..., cpu_paths={"bf16_gemm": "widened"})``) or for the process (``LAB_CPU_<NAME>=<candidate>``, read each
time an engine decides); ``CANDIDATES`` lists every name and its candidates. ``decisions()`` lists what was measured,
and the timings; ``Engine.cpu_paths`` and the benchmark CSVs report the choices with the CPU model and flags
(``cpu_info()``).

    >>> d = decide(Probe("bf16_gemm", key, {"native": f, "widened": g}))      # Decision(choice="native", ...)
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lab import env
from lab.ops.plan import CpuPlan

MARGIN = 1.03  # another candidate must be this much faster than the default to replace it
REPEATS = 5  # interleaved timings per candidate; the best one counts
# (the best, not the median: on a 2-vCPU VM the time just after a multi-threaded region ran slow, likely the OpenMP
# pool spinning on the sibling vCPU, and a median over 5 calls still carried it into one candidate's figure)
# untimed calls per candidate first: oneDNN's first calls at a new shape create and JIT its kernels, and its first
# few calls ran slow, which one warm-up call hid badly (measured: evals/README.md, "Measurements behind the code's
# choices")
WARMUP = 3
# every CPU fast-path choice a probe can make: name -> its candidates (the default of each probe comes first in the
# probe itself, which may offer fewer: those this machine or shape can run)
CANDIDATES: dict[str, tuple[str, ...]] = {
    "bf16_gemm": ("native", "widened"),  # lab.ops.gemm
    "f32_gemm": ("blas", "onednn"),
    "f32_weights": ("packed", "plain"),
    "bf16_weights": ("packed", "plain"),
    "attention_kernel": ("sdpa", "matmul", "lab", "bmm"),  # lab.ops.attention
    "bert_qkv": ("split", "stacked"),  # lab.models.bert
    "bert_ffn": ("blocks", "fused"),
    "add_layer_norm": ("torch", "lab"),
    "rope_layout": ("halves", "pairs"),  # lab.models.decoder
    "decoder_mlp": ("blocks", "stacked"),
    "causal_attention": ("whole", "blocks"),
    "add_rms_norm": ("torch", "lab"),
    "rope_kernel": ("torch", "lab"),
    "forward": ("eager", "compiled"),  # lab.runtime.compiled (decided per call: lab.runtime.planner.forward_choice)
}
# choices made per call rather than by a model family's probes at load (``lab.runtime.planner.forward_choice``)
CALL_PROBES = ("forward",)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_vnni", "fma")


@dataclass(frozen=True)
class Probe:
    """One choice: ``candidates`` (name -> a zero-argument callable running that implementation once on prepared
    inputs; the first is the default) for the step ``name`` at shape class ``key`` (a tuple of ints / strings)."""

    name: str
    key: tuple
    candidates: dict[str, Callable[[], object]]
    threads: int = 1  # intra-op threads the step runs with (one CPU worker's share)

    def __post_init__(self):
        unknown = set(self.candidates) - set(CANDIDATES.get(self.name, ()))
        if self.name not in CANDIDATES or unknown or not self.candidates:
            raise ValueError(
                f"probe {self.name!r} offers {list(self.candidates)}, not registered in lab.ops.probes.CANDIDATES"
            )


@dataclass
class Decision:
    name: str
    key: tuple
    choice: str
    source: str  # "probe" | "engine" (the engine's cpu_paths) | "env" (LAB_CPU_<NAME>)
    seconds: dict[str, float] = field(default_factory=dict)  # best timing per candidate (probe only)
    threads: int = 1  # the intra-op threads it was decided for (one CPU worker's share)

    def __str__(self) -> str:
        timing = ", ".join(f"{c} {s * 1e3:.2f} ms" for c, s in self.seconds.items())
        return (
            f"{self.name}{list(self.key)} x{self.threads} thread(s): {self.choice} "
            f"({self.source}{'; ' + timing if timing else ''})"
        )


_MEASURED: dict[tuple, Decision] = {}
# Reentrant: a KeyboardInterrupt can land on the ``with`` line's exit (Python runs the lock's ``__exit__`` from that
# line's bytecode, after a line event where a Ctrl-C or a tracer may raise), leaving the lock held by the interrupted
# thread; with a plain Lock that thread's next ``decide`` (the next load or ``configure``) then waited forever.
_LOCK = threading.RLock()


def env_name(name: str) -> str:
    return f"LAB_CPU_{name.upper()}"


def check_environment() -> None:
    """Refuse a ``LAB_CPU_<NAME>`` variable that names no fast path (a typo would otherwise force nothing, silently):
    a ``ValueError`` naming it and the valid names."""
    import os

    known = {env_name(n) for n in CANDIDATES} | {"LAB_CPU_NATIVE_KERNELS"}
    unknown = sorted(k for k in os.environ if k.startswith("LAB_CPU_") and k not in known)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: no such CPU fast path; the LAB_CPU_<NAME> variables are "
            f"{', '.join(sorted(known))} (unset the variable, or correct its name)"
        )


def check_forced(forced: dict[str, str] | None) -> dict[str, str]:
    """An engine's ``cpu_paths`` argument, checked against ``CANDIDATES``: a dict of name -> candidate; the
    process's ``LAB_CPU_<NAME>`` variables checked too (``check_environment``)."""
    check_environment()
    if forced is None:
        return {}
    if not isinstance(forced, dict):
        raise TypeError(f"cpu_paths must be a dict of fast-path name -> choice, got {type(forced).__name__}")
    for name, choice in forced.items():
        if name not in CANDIDATES:
            raise ValueError(f"cpu_paths: unknown fast path {name!r}; valid: {', '.join(CANDIDATES)}")
        if choice not in CANDIDATES[name]:
            raise ValueError(f"cpu_paths[{name!r}]={choice!r} is not a choice; valid: {', '.join(CANDIDATES[name])}")
    return dict(forced)


def decide(probe: Probe, *, forced: dict[str, str] | None = None, context: tuple = ()) -> Decision:
    """The choice for ``probe``: ``forced[probe.name]`` (an engine's ``cpu_paths``), else ``LAB_CPU_<NAME>`` (read
    now; ``auto`` or unset: no force), else the measurement cached for ``probe.key``, its thread layout and
    ``context`` (the choices made before it, which its candidates run with), measuring now if there is none."""
    made = forced_choice(probe, forced)
    if made is not None:
        return made
    k = (probe.name, probe.key, probe.threads, tuple(probe.candidates), context)
    with _LOCK:
        if k not in _MEASURED:
            _MEASURED[k] = _measure(probe)
        return _MEASURED[k]


def forced_choice(probe: Probe, forced: dict[str, str] | None = None) -> Decision | None:
    """``probe``'s choice forced by ``forced`` (an engine's ``cpu_paths``) or ``LAB_CPU_<NAME>`` (read now), else
    ``None`` (``auto`` or unset: measure)."""
    choice = (forced or {}).get(probe.name)
    if choice not in (None, "auto"):
        if choice not in probe.candidates:
            raise ValueError(
                f"cpu_paths[{probe.name!r}]={choice!r} is not a {probe.name} choice on this machine at "
                f"this shape; valid: {', '.join(probe.candidates)}"
            )
        return Decision(probe.name, probe.key, choice, "engine", threads=probe.threads)
    choice = env.choice(
        env_name(probe.name),
        (*probe.candidates, "auto"),
        "auto",
        what=f"a {probe.name} choice on this machine at this shape",
    )
    if choice != "auto":
        return Decision(probe.name, probe.key, choice, "env", threads=probe.threads)
    return None


def decisions() -> list[Decision]:
    """Every measurement this process made, in order."""
    return list(_MEASURED.values())


def choose(probe: Probe, fastest: dict[str, float]) -> str:
    """The margin rule: the fastest candidate by ``fastest`` (best seconds per candidate), if it beats the default
    (the probe's first candidate) by at least ``MARGIN``; else the default."""
    default = next(iter(probe.candidates))
    best = min(fastest, key=fastest.get)
    return best if fastest[best] * MARGIN < fastest[default] else default


def _measure(probe: Probe) -> Decision:
    if len(probe.candidates) == 1:  # nothing to time
        return Decision(probe.name, probe.key, next(iter(probe.candidates)), "probe", {}, probe.threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, probe.threads))
    try:
        with torch.inference_mode():
            for fn in probe.candidates.values():  # warm-up: first calls allocate and pick (or JIT) kernels
                for _ in range(WARMUP):
                    fn()
            times: dict[str, list[float]] = {c: [] for c in probe.candidates}
            for _ in range(REPEATS):  # interleaved, so drift hits every candidate alike
                for c, fn in probe.candidates.items():
                    t0 = time.perf_counter()
                    fn()
                    times[c].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    fastest = {c: min(t) for c, t in times.items()}
    return Decision(probe.name, probe.key, choose(probe, fastest), "probe", fastest, probe.threads)


def cpu_info() -> dict[str, str]:
    """The CPU model, its flags that matter for the fast paths, and torch's build / thread count."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_flags": " ".join(f for f in FLAGS if f in flags),
        "isa": isa(flags),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
    }


def isa(flags) -> str:
    """The widest matrix / vector ISA of a CPU by its flags, what decides which GEMMs win there: ``amx`` (AMX
    bfloat16 tiles), ``avx512_bf16``, ``avx512``, ``avx2`` or ``none``."""
    flags = set(flags)
    for name, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return name
    return "none"


def machine_slug(info: dict[str, str] | None = None) -> str:
    """A short file-name-safe name for this CPU, the suffix of every benchmark result file: the model name's words
    lower-cased, trademarks, "CPU", "Processor", core counts and clock speeds dropped
    (``Intel(R) Xeon(R) Platinum 8488C CPU @ 2.40GHz`` -> ``intel-xeon-platinum-8488c``), then the ISA (``isa``)
    where the flags are known (this machine's, or ``info["cpu_flags"]``): ``intel-xeon-platinum-8488c-amx``. A name
    with no model number (a VM that reports only ``AMD EPYC``) gets the CPU family and model from ``/proc/cpuinfo``
    (``amd-epyc-f25m1-avx2``), so two generations never share a file.

        >>> machine_slug({"cpu_model": "Intel(R) Xeon(R) Platinum 8488C CPU @ 2.40GHz"})
        'intel-xeon-platinum-8488c'
    """
    import re

    live = info is None
    info = info or cpu_info()
    name = info["cpu_model"]
    name = re.sub(r"\((R|TM|r|tm)\)|@.*$|\b(CPU|Processor|[0-9]+-Core)\b", " ", name)
    words = [w for w in re.split(r"[^A-Za-z0-9.]+", name.lower()) if w]
    slug = "-".join(words) or platform.machine().lower() or "cpu"
    if live and not any(ch.isdigit() for ch in slug):
        fields = {}
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() in ("cpu family", "model") and key.strip() not in fields:
                        fields[key.strip()] = value.strip()
                    if not line.strip():
                        break
        except OSError:
            pass
        if "cpu family" in fields and "model" in fields:
            slug += f"-f{fields['cpu family']}m{fields['model']}"
    if "cpu_flags" in info:
        slug += f"-{isa(info['cpu_flags'].split())}"
    return slug


def gemm_probes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int, plan: CpuPlan
) -> Iterator[Probe]:
    """The GEMM choices for ``x``'s dtype at one of a model's shapes: the implementation (``bf16_gemm_probe`` for
    bfloat16, ``f32_gemm_probe`` for float32), then, where the choice just made sends that dtype's GEMMs to oneDNN,
    the weight layout (``weights_probe``). A generator: the planner puts each choice into ``plan`` before asking for
    the next probe."""
    if x.dtype == torch.bfloat16:
        yield bf16_gemm_probe(x, weight, bias, threads)
    elif x.dtype == torch.float32:
        yield f32_gemm_probe(x, weight, bias, threads)
    else:
        return
    probe = weights_probe(x, weight, bias, threads, plan)
    if probe is not None:
        yield probe


def weights_probe(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int, plan: CpuPlan
) -> Probe | None:
    """oneDNN's GEMM on the weight reordered once into its blocked layout (``packed``, the default: the same
    products, faster, most at few rows: ``lab.ops.gemm``) against the weight as stored (``plain``, reordered in
    blocks on every call), at one of a model's shapes, where ``x``'s
    dtype runs through oneDNN under ``plan`` (``lab.ops.gemm.onednn_gemms``) and torch can reorder; else ``None``. The
    packed copy costs one more copy of every projection weight (``cpu_paths={"f32_weights": "plain"}`` or
    ``LAB_CPU_F32_WEIGHTS=plain`` / ``..._BF16_WEIGHTS`` keep the memory)."""
    from lab.ops.gemm import onednn_gemms, onednn_linear, onednn_packing, packed_weight

    if not (onednn_packing() and onednn_gemms(x.dtype, plan) and weight.dtype == x.dtype and weight.is_contiguous()):
        return None
    packed = packed_weight(weight, plan)  # made before the timing, as the engine keeps it
    name = "f32_weights" if x.dtype == torch.float32 else "bf16_weights"
    return Probe(
        name,
        (str(x.dtype).removeprefix("torch."), x.shape[1], weight.shape[0]),
        {"packed": lambda: onednn_linear(x, packed, bias), "plain": lambda: onednn_linear(x, weight, bias)},
        threads,
    )


def f32_gemm_probe(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Probe:
    """torch's BLAS float32 GEMM (``F.linear``, the default) against oneDNN's (``lab.ops.gemm.onednn_linear``,
    offered where this torch build has it) at one of a model's shapes."""
    from lab.ops.gemm import onednn_cpu, onednn_linear

    candidates = {"blas": lambda: F.linear(x, weight, bias)}
    if onednn_cpu():
        candidates["onednn"] = lambda: onednn_linear(x, weight, bias)
    return Probe("f32_gemm", ("float32", x.shape[1], weight.shape[0]), candidates, threads)


def bf16_gemm_probe(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> Probe:
    """Native bfloat16 GEMM (the default; oneDNN's linear op where it takes bfloat16, as
    ``lab.ops.gemm.linear`` calls it, else ``F.linear``) against the widened one (float32 GEMM over the bfloat16
    values, with the float32 weight made beforehand, as ``lab.ops.gemm.wide_weight`` keeps it) at one of a
    model's shapes."""
    from lab.ops.gemm import onednn_bf16, onednn_linear

    native = onednn_linear if onednn_bf16() else F.linear
    w32, b32 = weight.float(), None if bias is None else bias.float()
    return Probe(
        "bf16_gemm",
        ("bfloat16", x.shape[1], weight.shape[0]),
        {"native": lambda: native(x, weight, bias), "widened": lambda: F.linear(x.float(), w32, b32).bfloat16()},
        threads,
    )


# sequence lengths of the ``attention_kernel`` probe's step (512 tokens): the kernels' speeds order differently at
# different lengths, so the probe times a mix like the steps the scheduler forms, short sentences to long passages
ATTENTION_PROBE_LENGTHS = (224, 64, 64, 24, 24, 24, 24) + (8,) * 8


def attention_probe(
    dtype: torch.dtype,
    heads: int,
    d: int,
    threads: int,
    *,
    kv_heads: int | None = None,
    causal: bool = False,
    causal_block: int | None = None,
    kernels: tuple[str, ...] = ("sdpa", "matmul", "lab", "bmm"),
) -> Probe:
    """The attention kernel (``lab.ops.attention.KERNELS``) on one step of ``ATTENTION_PROBE_LENGTHS``, through
    ``lab.ops.attention.attention`` as a layer calls it: torch's fused kernel (``sdpa``, the default), scores, softmax
    and weighted sum as three ops (``matmul``: ``lab.kernels.reference._matmul_attention``), prefill-lab's own CPU
    kernel (``lab``: ``lab.kernels.cpu_attention``, offered where it built on this machine and takes the shapes), the
    two products as batched GEMMs over head-major copies (``bmm``: ``lab.ops.attention.bmm_attention``; oneDNN's
    bfloat16 kernels, AMX where the CPU has it).

    ``matmul`` and ``bmm`` are for encoders only: they round the scores to the inputs' dtype, and decoder LLMs'
    attention logits are large and sharp (SmolLM2 bidirectional in bfloat16, 48 mixed texts: the worst embedding's
    cosine to the float32 engine fell from 0.981 with the fused kernel to 0.939 with ``matmul``, while MiniLM's
    stayed within ~1e-5). A probe times speed only, so decoders pass ``kernels=("sdpa", "lab")``. ``lab`` keeps the
    scores, the softmax and the weighted sum in float32 (bfloat16 scores are exact sums of exact products): SmolLM2
    bidirectional in bfloat16, 240 mixed texts against the float32 engine, median cosine 0.99994 with either kernel,
    5th percentile 0.991 / 0.990 (``lab`` / fused); that mode's worst texts are fragile under any rounding change
    (0.877 / 0.915). ``causal_block``: the torch path's query blocks for long causal sequences (a decoder's
    ``causal_attention`` choice), used by ``sdpa`` and ``matmul`` here as in the layer."""
    from lab.kernels import cpu_attention
    from lab.ops.attention import attention
    from lab.ops.batch import AttnMeta

    kv_heads = kv_heads or heads
    meta = AttnMeta.from_lengths(list(ATTENTION_PROBE_LENGTHS), causal=causal)
    q = torch.randn(meta.num_tokens, heads, d, dtype=dtype)
    k, v = (torch.randn(meta.num_tokens, kv_heads, d, dtype=dtype) for _ in range(2))
    if "lab" in kernels and not (cpu_attention.supports(q, k) and cpu_attention.available()):
        kernels = tuple(c for c in kernels if c != "lab")
    return Probe(
        "attention_kernel",
        (str(dtype), heads, kv_heads, d, "causal" if causal else "bidirectional", causal_block or 0),
        {m: (lambda m=m: attention(q, k, v, meta, 0, causal_block=causal_block, kernel=m)) for m in kernels},
        threads,
    )
