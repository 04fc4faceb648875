"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over packed tokens: one class, differences as config fields.

Our own implementation, checked against transformers' ``LlamaModel`` / ``MistralModel`` / ``Qwen2Model`` /
``Qwen3Model`` on the same weights. What differs between the four is read from ``config.json`` into
``DecoderArgs``: biases on the q/k/v (Qwen2) and output projections, per-head RMSNorm of queries and keys before
RoPE (Qwen3), an explicit ``head_dim``, grouped-query attention, RoPE scaling (``lab.models.rope``), tied input and
output embeddings, and the bidirectional flag of embedding models that turned causal attention off. The model sees
flat tokens ``(T,)``, their positions and an ``AttnMeta``; q/k/v and gate/up projections are fused at load time.

    >>> model = DecoderModel.from_hf_config(config); model.load_hf_state_dict(state_dict)
    >>> hidden = model(input_ids, positions, meta)                       # (T, hidden), final RMSNorm applied
    >>> yes_no = model.lm_logits(hidden[last], token_ids=[yes_id, no_id])  # (N, 2)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lab.kernels import cpu_norms, cpu_rope
from lab.models.base import PackedModel
from lab.models.checks import check_shape
from lab.models.folder import KeyTracker, warn_unexpected
from lab.models.rope import (
    RopeSpec,
    RopeTables,
    pairs_order,
    pairs_rows,
    rope_from_config,
    rotate_pairs_,
    rotate_qk_,
)
from lab.ops.attention import attention, ops
from lab.ops.batch import AttnMeta, OutputRows
from lab.ops.gemm import ACTIVATIONS, Linear, activation_inplace, check_activation, linear, row_blocks
from lab.ops.plan import CpuPlan
from lab.ops.probes import Probe, attention_probe, gemm_probes

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Tokens per FFN block on CPU. The gate/up activations of a 16k-token step are ~200 MB for SmolLM2 and leave the
# caches between the GEMMs and the gating; 4096-row blocks ran faster end to end in float32, alike in bfloat16
# (measured with the stacked gate/up GEMM, kept with the split one: evals/README.md, "Measurements behind the code's
# choices").
MLP_ROWS = 4096
PROBE_ROWS = 512  # tokens per probe step (``DecoderModel.cpu_probes``): one worker's GEMMs, a few ms each
# Query block of causal attention on CPU when the probe picks ``blocks`` (``lab.kernels.reference._causal_blocks``):
# 64 beat 32 and 128 in float32 and bfloat16 (measured: evals/README.md, "Measurements behind the code's choices").
CAUSAL_BLOCK = 64


def causal_block(plan: CpuPlan) -> int | None:
    """The query block causal attention runs with under ``plan`` (``CAUSAL_BLOCK`` when its ``causal_attention`` is
    ``blocks``, else ``None``): what a layer passes and what the ``attention_kernel`` probe times."""
    return CAUSAL_BLOCK if plan.get("causal_attention") == "blocks" else None


@dataclass
class DecoderArgs:
    """Everything the forward pass needs from ``config.json``, with each family's defaults filled in."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool  # Qwen2: always; Llama / Qwen3: attention_bias
    o_bias: bool  # Llama / Qwen3: attention_bias; Qwen2 / Mistral: never
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim of each query / key head, before RoPE
    tie_word_embeddings: bool
    causal: bool
    sliding_window: int | None  # smallest window any layer uses; longer contexts are refused (not implemented)
    max_position_embeddings: int | None

    @classmethod
    def from_config(cls, c: dict) -> DecoderArgs:
        mt = c.get("model_type", "llama")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not a Llama-family decoder; supported: {', '.join(MODEL_TYPES)}")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or (128 if mt == "qwen3" else c["hidden_size"] // heads)  # Qwen3Config default
        attention_bias = bool(c.get("attention_bias", False))
        act = c.get("hidden_act", "silu")
        check_activation(act)
        return cls(
            model_type=mt,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            hidden_act=act,
            qkv_bias=True if mt == "qwen2" else (attention_bias and mt != "mistral"),
            o_bias=attention_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(c.get("mlp_bias", False)) and mt == "llama",
            qk_norm=mt == "qwen3",
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            causal=c.get("is_causal", True) is not False and not c.get("use_bidirectional_attention", False),
            sliding_window=_sliding_window(c, mt),
            max_position_embeddings=c.get("max_position_embeddings"),
        )


def _sliding_window(c: dict, mt: str) -> int | None:
    window = c.get("sliding_window")
    if window is None:
        return None
    if mt == "mistral":
        return window
    if mt in ("qwen2", "qwen3"):
        types = c.get("layer_types")
        if types is not None:
            return window if "sliding_attention" in types else None
        if not c.get("use_sliding_window", False):
            return None
        return window if c.get("max_window_layers", 28) < c["num_hidden_layers"] else None
    return None


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, meta: AttnMeta, plan: CpuPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) * weight, x + residual)``: in ``lab.kernels.cpu_norms`` (one pass per row) where the
    ``add_rms_norm`` probe chose it, the torch backend runs, the kernel takes ``x`` and nothing records gradients (it
    has no backward); elsewhere, and by default, the backend's ops."""
    if cpu_norms.chosen(plan.get("add_rms_norm"), meta.backend, x, weight):
        return cpu_norms.add_rms_norm(x, residual, weight, eps)
    return ops(meta).add_rms_norm(x, residual, weight, eps)


def _rope_kernel(q: torch.Tensor, meta: AttnMeta, plan: CpuPlan):
    """The ``pairs`` rotation a layer runs: ``lab.kernels.cpu_rope``'s where the ``rope_kernel`` probe chose it and
    it applies (``cpu_rope.chosen``), else torch's (``lab.models.rope.rotate_pairs_``)."""
    return cpu_rope.rotate_pairs_ if cpu_rope.chosen(plan.get("rope_kernel"), meta.backend, q) else rotate_pairs_


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the residual adds live in the norms."""

    def __init__(self, a: DecoderArgs, index: int, plan: CpuPlan):
        super().__init__()
        self.plan = plan  # the model's CPU plan (``PackedModel.plan``), read on every call
        self.index, self.eps = index, a.rms_norm_eps
        self.hq, self.hkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.ln_attn = nn.Parameter(torch.empty(a.hidden_size))
        self.ln_mlp = nn.Parameter(torch.empty(a.hidden_size))
        self.qkv = Linear(a.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=a.qkv_bias, plan=plan)  # fused q/k/v
        self.o = Linear(self.hq * self.d, a.hidden_size, bias=a.o_bias, plan=plan)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(self.d))
            self.k_norm = nn.Parameter(torch.empty(self.d))
        else:
            self.q_norm = self.k_norm = None
        self.inter = a.intermediate_size
        self.gate_up = Linear(a.hidden_size, 2 * self.inter, bias=a.mlp_bias, plan=plan)  # fused gate/up
        self.down = Linear(self.inter, a.hidden_size, bias=a.mlp_bias, plan=plan)
        self.act = ACTIVATIONS[a.hidden_act]
        self.act_inplace = activation_inplace(a.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        meta: AttnMeta,
        only: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this block's input delta ``(T, hidden)``, residual: the running sum (``None`` before block 0); rope:
        the step's rotation tables, in the model's head layout (``DecoderModel.rope_layout``).

        ``only``: compute the block's output for ``only.rows`` alone, ``(B, hidden)`` (the last block under ``cls`` /
        ``lasttoken`` pooling): keys and values from every row, queries and everything after attention from those
        rows. For SmolLM2 (30 blocks) that skips ~3 % of the forward's FLOPs."""
        k_ops = ops(meta)
        t = x.shape[0]
        h, residual = add_rms_norm(x, residual, self.ln_attn, self.eps, meta, self.plan)
        nq, nk = self.hq * self.d, self.hkv * self.d
        if only is None:
            qkv = self.qkv(h)  # (T, (Hq + 2 Hkv) * D)
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
            q_rope = rope
        else:
            w, b = self.qkv.weight, self.qkv.bias
            q = linear(h[only.rows], w[:nq], None if b is None else b[:nq], plan=self.plan)  # (B, Hq * D)
            kv = linear(h, w[nq:], None if b is None else b[nq:], plan=self.plan)  # (T, 2 Hkv * D)
            k, v = kv[:, :nk], kv[:, nk:]
            q_rope, residual = rope.rows(only.rows), residual[only.rows]
        tq = q.shape[0]
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's D features
            q = k_ops.add_rms_norm(q.reshape(tq * self.hq, self.d), None, self.q_norm, self.eps)[0]
            k = k_ops.add_rms_norm(k.reshape(t * self.hkv, self.d), None, self.k_norm, self.eps)[0]
        q, k, v = q.view(tq, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        # queries and keys side by side in qkv (no q/k norm, every row): one pass in the pairs layout
        both = qkv[:, : nq + nk].view(t, self.hq + self.hkv, self.d) if only is None and self.q_norm is None else None
        rotate_qk_(
            q, k, rope, q_rope, both, apply_halves=k_ops.apply_rotary, apply_pairs=_rope_kernel(q, meta, self.plan)
        )  # in place
        if only is None:
            a = attention(
                q,
                k,
                v,
                meta,
                self.index,
                causal_block=causal_block(self.plan),
                kernel=self.plan.get("attention_kernel", "sdpa"),
            )  # (T, Hq, D)
        else:
            a = attention(q, k[only.rows], v[only.rows], only.step_meta(meta, self.index, k, v), self.index)
        h, residual = add_rms_norm(self.o(a.reshape(tq, nq)), residual, self.ln_mlp, self.eps, meta, self.plan)
        return self._mlp(h), residual

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(h)) * up(h))``.

        ``stacked`` (CUDA): one GEMM over the stacked gate/up weight. ``blocks`` (the CPU default): separate gate and
        up GEMMs (row slices of that weight, no copies), in row blocks of ``MLP_ROWS`` tokens, activation and gating
        in place and the down projection written into the output. On CPU a probe picks one (``decoder_mlp``,
        ``DecoderModel.cpu_probes``): MKL's float32 GEMM can run at a lower rate on the stacked weight's wider output
        (SmolLM2's N = 3072) than on each half, and the whole FFN faster in blocks (measured: evals/README.md,
        "Measurements behind the code's choices").
        """
        i = self.inter
        if h.device.type != "cpu" or self.plan.get("decoder_mlp") == "stacked" or torch.compiler.is_compiling():
            gu = self.gate_up(h)  # (T, 2 I)
            return self.down(self.act(gu[:, :i]).mul_(gu[:, i:]))
        w, b = self.gate_up.weight, self.gate_up.bias
        gate_w, up_w = w[:i], w[i:]
        gate_b, up_b = (None, None) if b is None else (b[:i], b[i:])
        plan = self.plan
        return row_blocks(
            h,
            self.down.weight,
            self.down.bias,
            MLP_ROWS,
            lambda rows: self.act_inplace(linear(rows, gate_w, gate_b, plan=plan)).mul_(
                linear(rows, up_w, up_b, plan=plan)
            ),
            plan=plan,
        )


class DecoderModel(PackedModel):
    """Llama / Mistral / Qwen2 / Qwen3 decoder stack over packed tokens; returns final-normed hidden states.

    Parameters are created on the ``meta`` device (no random init of weights that are about to be overwritten)
    and materialized by ``load_hf_state_dict`` in the dtype the module has then; move / cast it after loading.
    """

    is_decoder = True
    computes_output_rows = True  # forward(..., output_rows=...) runs its last layer for those rows only

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        a = self.args = DecoderArgs.from_config(config)
        self.hidden_size, self.num_layers = a.hidden_size, a.num_layers
        self.max_positions = a.max_position_embeddings
        self.default_causal = a.causal
        self.eps = a.rms_norm_eps
        self.rope: RopeSpec = rope_from_config(config, a.head_dim)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # float32 per device; kept out of .to(dtype)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(a, i, self.plan) for i in range(a.num_layers))
            self.norm = nn.Parameter(torch.empty(a.hidden_size))
            self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    @classmethod
    def from_hf_config(cls, config: dict) -> DecoderModel:
        return cls(config)

    # ------------------------------------------------ stages (``PackedModel.forward`` runs them in order)
    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttnMeta
    ) -> torch.Tensor:
        """Input of layer 0: ``(T, hidden)`` (``token_type_ids`` unused)."""
        return self.embed_tokens(input_ids)

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMeta,
        layers: range,
        residual: torch.Tensor | None = None,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm blocks ``layers`` from ``x`` (a block's output delta, or the hidden states with ``residual``
        ``None``) -> ``(delta, residual)``: the hidden states are their sum, which the next block's norm (or
        ``finish``) adds. ``output_rows``: the last block of ``layers`` computes those rows only."""
        rope = RopeTables.at(positions, self._freqs(x.device), self.rope.attention_scaling, self.rope_layout, x.dtype)
        last = layers[-1]
        for i in layers:
            x, residual = self.layers[i](x, residual, rope, meta, output_rows if i == last else None)
        return x, residual

    @property
    def rope_layout(self) -> str:
        """How each query / key head orders its features: ``halves`` (transformers') or ``pairs``
        (``lab.models.rope``), fixed when the weights load (``layout_probes``)."""
        return self.layout.get("rope_layout", "halves")

    def ffn_rows(self, device: torch.device, dtype: torch.dtype) -> int | None:
        """``MLP_ROWS`` where ``DecoderLayer._mlp`` runs in row blocks (CPU, unless the plan stacked it)."""
        return None if device.type != "cpu" or self.plan.get("decoder_mlp") == "stacked" else MLP_ROWS

    def layout_probes(self, dtype: torch.dtype) -> Iterator[Probe]:
        """The rotary layout: ``halves`` (``apply_rotary``'s six half-width passes over the query and key heads) or
        ``pairs`` (query / key projection rows permuted at load, the rotation one complex multiply in place, faster,
        most in float32: ``lab.models.rope.rotate_pairs_``). Timed on one thread over ``PROBE_ROWS`` tokens of a fused
        q/k/v output, as the forward rotates them."""
        a = self.args
        q, k, both = self._rotation_inputs(dtype)
        tables = {layout: self._rotation_tables(layout, dtype) for layout in ("halves", "pairs")}
        yield Probe(
            "rope_layout",
            (str(dtype), a.num_heads, a.num_kv_heads, a.head_dim),
            {layout: (lambda r=rope: rotate_qk_(q, k, r, both=both)) for layout, rope in tables.items()},
        )

    def _rotation_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries, keys and their joint view (``rotate_qk_``'s ``both``) over ``PROBE_ROWS`` tokens of a random
        fused q/k/v output, as ``DecoderLayer.forward`` rotates them (normed queries and keys, Qwen3: no joint
        view, they are separate tensors)."""
        a = self.args
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = torch.randn(PROBE_ROWS, (hq + 2 * hkv) * d, dtype=dtype)
        q, k = qkv[:, : hq * d].view(-1, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
        return q, k, None if a.qk_norm else qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d)

    def _rotation_tables(self, layout: str, dtype: torch.dtype) -> RopeTables:
        return RopeTables.at(torch.arange(PROBE_ROWS), self.rope.inv_freq, self.rope.attention_scaling, layout, dtype)

    def cpu_probes(self, dtype: torch.dtype, threads: int) -> Iterator[Probe]:
        """The GEMM implementation (bfloat16: native vs widened; float32: BLAS vs oneDNN; at the gate projection's
        shape), then the MLP in row blocks with split gate/up GEMMs vs one stacked GEMM (``DecoderLayer._mlp``), on
        layer 0's weights, then causal attention over whole sequences vs in query blocks of ``CAUSAL_BLOCK`` (one
        sequence of ``PROBE_ROWS`` tokens, where blocks win by a clear margin; at half that length the margin is
        small enough that noise picked ``whole`` and slowed SmolLM2's bfloat16 attention; measured: evals/README.md,
        "Measurements behind the code's choices"), then that torch path vs prefill-lab's own kernel
        (``attention_kernel``: ``sdpa`` or ``lab``, ``lab.ops.probes.attention_probe``; never the three-op
        ``matmul``, which rounds scores to bfloat16), on a causal step of mixed lengths; then the pre-norms: torch's
        add and RMSNorm or prefill-lab's one-pass kernel (``add_rms_norm``; ``lab.kernels.cpu_norms``, offered where
        the C library built); then, in the ``pairs`` rotary layout, the rotation: torch's or the same library's one
        pass (``rope_kernel``; ``lab.kernels.cpu_rope``)."""
        layer = self.layers[0]
        x = torch.randn(PROBE_ROWS, self.hidden_size, dtype=dtype)
        b = layer.gate_up.bias
        yield from gemm_probes(
            x, layer.gate_up.weight[: layer.inter], None if b is None else b[: layer.inter], threads, self.plan
        )

        def mlp(choice: str):
            self.plan["decoder_mlp"] = choice
            return layer._mlp(x)

        yield Probe(
            "decoder_mlp",
            (str(dtype), self.hidden_size, layer.inter),
            {"blocks": lambda: mlp("blocks"), "stacked": lambda: mlp("stacked")},
            threads,
        )

        meta = AttnMeta.from_lengths([PROBE_ROWS], causal=True)
        q = torch.randn(PROBE_ROWS, layer.hq, layer.d, dtype=dtype)
        k, v = (torch.randn(PROBE_ROWS, layer.hkv, layer.d, dtype=dtype) for _ in range(2))
        yield Probe(
            "causal_attention",
            (str(dtype), layer.hq, layer.hkv, layer.d),
            {
                "whole": lambda: attention(q, k, v, meta, 0),
                "blocks": lambda: attention(q, k, v, meta, 0, causal_block=CAUSAL_BLOCK),
            },
            threads,
        )
        yield attention_probe(
            dtype,
            layer.hq,
            layer.d,
            threads,
            kv_heads=layer.hkv,
            causal=True,
            causal_block=causal_block(self.plan),
            kernels=("sdpa", "lab"),
        )
        h, w, eps = torch.randn(PROBE_ROWS, self.hidden_size, dtype=dtype), layer.ln_mlp, self.eps
        if cpu_norms.supports(h, w) and cpu_norms.available():
            yield Probe(
                "add_rms_norm",
                (str(dtype), self.hidden_size),
                {
                    "torch": lambda: ops("torch").add_rms_norm(h, x, w, eps),
                    "lab": lambda: cpu_norms.add_rms_norm(h, x, w, eps),
                },
                threads,
            )
        if self.rope_layout == "pairs" and cpu_rope.available():
            q, k, both = self._rotation_inputs(dtype)
            pairs = self._rotation_tables("pairs", dtype)
            if cpu_rope.supports(q, pairs.cis):
                yield Probe(
                    "rope_kernel",
                    (str(dtype), q.shape[1] + k.shape[1], q.shape[2]),
                    {
                        kernel: (lambda f=f: rotate_qk_(q, k, pairs, both=both, apply_pairs=f))
                        for kernel, f in (("torch", rotate_pairs_), ("lab", cpu_rope.rotate_pairs_))
                    },
                    threads,
                )

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttnMeta, *, last: bool) -> torch.Tensor:
        """The final RMSNorm after the last block (transformers' ``last_hidden_state``); below it, the residual
        stream ``x + residual`` without a norm (transformers' ``hidden_states[k]``)."""
        if not last:
            return x if residual is None else x + residual
        return add_rms_norm(x, residual, self.norm, self.eps, meta, self.plan)[0]

    @property
    def has_lm_head(self) -> bool:
        return self.lm_head is not None or self.args.tie_word_embeddings

    def lm_logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Language-model logits ``(N, V)`` of hidden states ``(N, hidden)``, or only the columns ``token_ids``."""
        if self.lm_head is not None:
            w = self.lm_head.weight
        elif self.args.tie_word_embeddings:
            w = self.embed_tokens.weight
        else:
            raise ValueError("this checkpoint has no lm_head weights (an embedding-only export); no LM logits")
        if token_ids is not None:
            w = w[torch.as_tensor(token_ids, dtype=torch.long, device=w.device)]  # (len(ids), hidden)
        return hidden.to(w.dtype) @ w.T

    def _freqs(self, device: torch.device) -> torch.Tensor:
        f = self._inv_freq.get(device)
        if f is None:
            f = self._inv_freq[device] = self.rope.inv_freq.to(device)
        return f

    def check_context(self, longest: int) -> None:
        """Refuse contexts the implementation would get wrong (sliding windows, dynamic NTK), from host ints only."""
        limit = self.args.sliding_window
        why = "sliding-window attention is not implemented"
        if self.rope.max_context is not None and (limit is None or self.rope.max_context < limit):
            limit, why = self.rope.max_context, "dynamic NTK RoPE past max_position_embeddings is not implemented"
        if limit is not None and longest > limit:
            raise ValueError(f"a sequence spans {longest} tokens but only {limit} are supported: {why}")

    # ------------------------------------------------------------------------------------------------ loading
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load transformers weights (with or without the ``model.`` prefix); fuses q/k/v and gate/up.

        ``lm_head.weight`` is optional: tied configs use the embedding, and an untied checkpoint without it (an
        embedding-only export) simply has no LM logits. Raises ``KeyError`` naming every missing weight.
        """
        sd = KeyTracker({_strip(k): v for k, v in sd.items()}, source=sd)
        a = self.args
        missing: list[str] = []

        def take(key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
            if key not in sd:
                missing.append(key)
                return None
            return check_shape(sd, key, sd[key], shape)

        h, nq, nk, inter = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        new: dict[str, torch.Tensor | None] = {
            "embed_tokens.weight": take("embed_tokens.weight", (a.vocab_size, h)),
            "norm": take("norm.weight", (h,)),
        }
        for i in range(a.num_layers):
            p = o = f"layers.{i}."  # their prefix and ours happen to agree
            att, mlp = f"{p}self_attn.", f"{p}mlp."
            new[o + "ln_attn"] = take(f"{p}input_layernorm.weight", (h,))
            new[o + "ln_mlp"] = take(f"{p}post_attention_layernorm.weight", (h,))
            rows = {"q": nq, "k": nk, "v": nk}
            new[o + "qkv.weight"] = _cat([take(f"{att}{n}_proj.weight", (rows[n], h)) for n in "qkv"])
            if a.qkv_bias:
                new[o + "qkv.bias"] = _cat([take(f"{att}{n}_proj.bias", (rows[n],)) for n in "qkv"])
            new[o + "o.weight"] = take(f"{att}o_proj.weight", (h, nq))
            if a.o_bias:
                new[o + "o.bias"] = take(f"{att}o_proj.bias", (h,))
            if a.qk_norm:
                new[o + "q_norm"] = take(f"{att}q_norm.weight", (a.head_dim,))
                new[o + "k_norm"] = take(f"{att}k_norm.weight", (a.head_dim,))
            new[o + "gate_up.weight"] = _cat(
                [take(f"{mlp}gate_proj.weight", (inter, h)), take(f"{mlp}up_proj.weight", (inter, h))]
            )
            new[o + "down.weight"] = take(f"{mlp}down_proj.weight", (h, inter))
            if a.mlp_bias:
                new[o + "gate_up.bias"] = _cat(
                    [take(f"{mlp}gate_proj.bias", (inter,)), take(f"{mlp}up_proj.bias", (inter,))]
                )
                new[o + "down.bias"] = take(f"{mlp}down_proj.bias", (h,))
        if missing:
            shown = ", ".join(missing[:12]) + (f" ... ({len(missing)} in all)" if len(missing) > 12 else "")
            near = sorted(sd)[:6]
            raise KeyError(f"{a.model_type} checkpoint is missing weights: {shown} (checkpoint has e.g. {near})")
        warn_unexpected(sd, a.model_type, ignore=("lm_head.weight", "rotary_emb."))
        if self.rope_layout == "pairs":  # each query / key head's features as (i, i + D/2) pairs
            nq, nk = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            rows = torch.cat(
                [
                    pairs_rows(a.num_heads, a.head_dim),
                    nq + pairs_rows(a.num_kv_heads, a.head_dim),
                    torch.arange(nq + nk, nq + 2 * nk),
                ]
            )
            order = pairs_order(a.head_dim)
            for i in range(a.num_layers):
                o = f"layers.{i}."
                for name in ("qkv.weight", "qkv.bias") if a.qkv_bias else ("qkv.weight",):
                    new[o + name] = new[o + name][rows]
                if a.qk_norm:
                    new[o + "q_norm"] = new[o + "q_norm"][order]
                    new[o + "k_norm"] = new[o + "k_norm"][order]
        if self.lm_head is not None:
            if "lm_head.weight" in sd:
                new["lm_head.weight"] = check_shape(sd, "lm_head.weight", sd["lm_head.weight"], (a.vocab_size, h))
            else:
                self.lm_head = None  # embedding-only export: no LM head to load
        own = dict(self.named_parameters())
        for name, t in new.items():
            if t.shape != own[name].shape:
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != {tuple(own[name].shape)}")
        # assign: the meta-device parameters become these tensors, cast to the module's current dtype
        self.load_state_dict({n: t.to(own[n].dtype) for n, t in new.items()}, strict=True, assign=True)

    def hf_linear_map(self) -> dict[str, tuple[str, slice | torch.Tensor]]:
        """Each transformers Linear (named as ``load_hf_state_dict`` reads it, prefixes stripped) -> our parameter
        and its rows: q/k/v are row blocks of the fused ``qkv`` (Hq*D, Hkv*D, Hkv*D), gate/up of ``gate_up``. LoRA
        adapters merge through this map (``lab.adapt.merge``); the embedding and ``lm_head`` are not in it. In the
        ``pairs`` rotary layout the q / k rows are index tensors: row ``j`` of transformers' weight is our row
        ``rows[j]``."""
        a = self.args
        nq, nk, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        q_rows, k_rows = slice(0, nq), slice(nq, nq + nk)
        if self.rope_layout == "pairs":
            q_rows = torch.argsort(pairs_rows(a.num_heads, a.head_dim))
            k_rows = nq + torch.argsort(pairs_rows(a.num_kv_heads, a.head_dim))
        out: dict[str, tuple[str, slice | torch.Tensor]] = {}
        for i in range(a.num_layers):
            att, mlp, o = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"layers.{i}."
            out[att + "q_proj"] = (o + "qkv.weight", q_rows)
            out[att + "k_proj"] = (o + "qkv.weight", k_rows)
            out[att + "v_proj"] = (o + "qkv.weight", slice(nq + nk, nq + 2 * nk))
            out[att + "o_proj"] = (o + "o.weight", slice(None))
            out[mlp + "gate_proj"] = (o + "gate_up.weight", slice(0, inter))
            out[mlp + "up_proj"] = (o + "gate_up.weight", slice(inter, 2 * inter))
            out[mlp + "down_proj"] = (o + "down.weight", slice(None))
        return out

    @staticmethod
    def hf_module_name(name: str) -> str:
        """A transformers module name with the checkpoint / PEFT prefixes ``load_hf_state_dict`` accepts removed."""
        return _strip(name)


_PREFIXES = ("model.", "base_model.model.model.", "base_model.model.", "transformer.")


def _strip(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(t is None for t in parts) else torch.cat(parts)
