"""The compiled forward: a model's packed, padding-free forward through ``torch.compile`` (inductor, frozen weights).

The same stages the eager forward runs (``PackedModel.embed`` -> ``run_layers`` -> ``finish``) are traced into one
graph. Under tracing the model code takes its plain torch paths (``torch.compiler.is_compiling()``: ``F.linear``
instead of oneDNN calls or widened copies, torch's norms and RoPE instead of prefill-lab's C kernels, one stacked
GEMM instead of row blocks), so inductor sees every GEMM and the elementwise work around it: it fuses residual adds,
LayerNorm / RMSNorm, GELU / SwiGLU and RoPE into few passes, and with ``freezing`` treats the weights as constants,
packing them once for its CPU GEMMs (oneDNN, or its own AMX / AVX-512 micro-kernels). The varlen attention stays one
registered op (``torch.ops.lab.varlen_attention``, ``lab.ops.attention.compiled_attention``) that runs the kernel
the plan chose, so the graph is whole across it and never sees the lengths of a step.

**Shapes.** The packed token count is dynamic (``dynamic=True``): one graph serves every step. Every step carries a
filler sequence of ``FILLER`` tokens at its end, so no step has one sequence or one token, the sizes inductor would
otherwise specialize and compile again for; its rows are dropped from the output (attention never crosses a
sequence, so it changes no other row).

**Keys.** A graph is built per (weights' dtype and merged-adapter digest, ``Weights.state``; causal or not; layers
run; token types present; the calling thread's intra-op threads, which dynamo guards and inductor compiles into its
loops: a step run undivided on every thread and one shared among CPU workers get a graph each), and the last
``MAX_GRAPHS`` are kept: frozen weights are constants of the graph, so new weights (a dtype switch, other adapters)
get a new graph and never run stale ones; going back to earlier weights finds theirs. Each graph gets its own code
object, so dynamo's guards and recompile limit of one never reach another's.

**Cost.** Building a graph compiles C++ (measured per machine in evals/README.md); inductor's on-disk caches
(``cache_dir``) spare a second process on the same machine part of it. Which steps run compiled is the runner's
choice (``lab.runtime.runner.Runner.forward_path``).

    >>> cf = CompiledForward(model, weights)
    >>> hidden = cf(batch, depth=model.num_layers)            # (T, hidden), as model(batch...) computes it
"""

from __future__ import annotations

import threading
import time
import types
from collections import OrderedDict

import torch

from lab._warn import warn
from lab.models.base import PackedModel
from lab.ops.batch import AttnMeta, PackedBatch
from lab.runtime.weights import Weights

FILLER = 2  # tokens of the sequence appended to every compiled step (module doc: no 0/1-size specialization)
MAX_GRAPHS = 4  # graphs kept per engine (each holds its frozen, packed copy of the weights)
OPTIONS = {"freezing": True}  # inductor options of every graph: the weights frozen as constants


def cache_dir() -> str:
    """Where inductor keeps compiled code between processes: ``TORCHINDUCTOR_CACHE_DIR``, by default
    ``/tmp/torchinductor_<user>`` (inductor's own rule)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def check_compile(compile: bool | None, forced: dict[str, str]) -> bool | None:
    """An engine's ``compile`` argument: ``None`` (measured per call), ``True`` or ``False``; it may not contradict
    ``cpu_paths["forward"]``."""
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be None (measured), True or False, got {compile!r}")
    wanted = forced.get("forward", "auto")
    if compile is not None and wanted != "auto" and wanted != ("compiled" if compile else "eager"):
        raise ValueError(f"compile={compile} contradicts cpu_paths['forward']={wanted!r}; give one of them")
    return compile


def supports(model: PackedModel, batch: PackedBatch, depth: int) -> bool:
    """Whether a step can run compiled: a staged, packed model, at least one layer, the torch backend, a plain
    prefill step (no cached keys/values: chunked prefill and the prefix cache run eagerly) with every key visible."""
    meta = batch.meta
    return (
        model.packed
        and model.staged
        and depth > 0
        and meta.backend == "torch"
        and meta.kv is None
        and meta.key_lens is None
        and meta.num_seqs > 0
    )


class CompileNotice(UserWarning):
    """A graph is being compiled (once per engine, weights and shape class; ``lab.runtime.compiled``)."""


class CompiledForward:
    """One engine's compiled graphs (module doc), built on first use per key."""

    def __init__(self, model: PackedModel, weights: Weights):
        self.model, self.weights = model, weights
        self._graphs: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # one build per key, whatever the workers ask at once
        self.compile_seconds: dict[tuple, float] = {}  # key -> seconds its first call took (trace + compile + run)
        self.failed: str | None = None  # why a build failed (then ``compile=None`` stops considering it)

    def built(self, causal: bool, depth: int) -> bool:
        """Whether a graph for the live weights, ``causal`` and ``depth`` exists (its compile is paid)."""
        return any(k[:4] == (*self.weights.state, causal, depth) for k in self.compile_seconds)

    def expected_seconds(self, depth: int, prior: tuple[float, float]) -> float:
        """What building a graph of ``depth`` layers is expected to cost: the slowest build this engine measured,
        scaled to ``depth`` layers, else ``prior`` (seconds: a base, and per layer)."""
        if self.compile_seconds:
            return max(s * max(depth, 1) / max(k[3], 1) for k, s in self.compile_seconds.items())
        return prior[0] + prior[1] * depth

    def key(self, causal: bool, depth: int, token_types: bool) -> tuple:
        return (*self.weights.state, causal, depth, token_types, torch.get_num_threads())

    def __call__(self, batch: PackedBatch, depth: int) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of ``batch`` after ``depth`` layers, as the eager forward computes them."""
        meta = batch.meta
        self.model.check_context(meta.max_seqlen)
        t = meta.num_tokens
        dev = batch.input_ids.device
        fill = torch.zeros(FILLER, dtype=batch.input_ids.dtype, device=dev)
        ids = torch.cat([batch.input_ids, fill])
        positions = torch.cat([batch.positions, torch.arange(FILLER, dtype=batch.positions.dtype, device=dev)])
        types_ = None if batch.token_type_ids is None else torch.cat([batch.token_type_ids, fill])
        cu = torch.cat([meta.cu_seqlens, meta.cu_seqlens.new_tensor([t + FILLER])])
        key = self.key(meta.causal, depth, types_ is not None)
        graph = self._graph(key)
        if key not in self.compile_seconds:
            with self._lock:
                if key not in self.compile_seconds:
                    warn(
                        CompileNotice(
                            f"compiling the forward ({type(self.model).__name__}, {key[0].removeprefix('torch.')}, "
                            f"{key[3]} layers, {'causal' if key[2] else 'bidirectional'}) with torch.compile: seconds "
                            f"to minutes, once per engine and weights; inductor caches its code in {cache_dir()}"
                        ),
                    )
                start = time.perf_counter()
                try:
                    out = graph(ids, positions, types_, cu)
                except Exception as e:  # the build failed (no C++ compiler, an op inductor cannot lower, ...)
                    self._graphs.pop(key, None)
                    self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                    raise RuntimeError(
                        f"torch.compile could not build the forward of this model ({self.failed}); "
                        "Engine(..., compile=False) runs it eagerly"
                    ) from e
                self.compile_seconds.setdefault(key, time.perf_counter() - start)
        else:
            out = graph(ids, positions, types_, cu)
        return out[:t]

    def _graph(self, key: tuple):
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = _build(self.model, causal=key[2], depth=key[3])
                while len(self._graphs) > MAX_GRAPHS:
                    old, _ = self._graphs.popitem(last=False)
                    self.compile_seconds.pop(old, None)
            self._graphs.move_to_end(key)
            return graph


def _build(model: PackedModel, *, causal: bool, depth: int):
    """A ``torch.compile``-d forward of ``model``'s first ``depth`` layers over flat inputs, on a code object of its
    own (module doc: keys)."""
    last = depth == model.num_layers

    def forward(input_ids, positions, token_type_ids, cu_seqlens):
        meta = AttnMeta(cu_seqlens, 0, causal, [])  # the lengths stay in cu_seqlens: the attention op reads them
        x = model.embed(input_ids, positions, token_type_ids, meta)
        x, residual = model.run_layers(x, positions, meta, range(depth))
        return model.finish(x, residual, meta, last=last)

    own = types.FunctionType(
        forward.__code__.replace(), forward.__globals__, "lab_compiled_forward", None, forward.__closure__
    )
    return torch.compile(own, dynamic=True, fullgraph=True, options=OPTIONS)
