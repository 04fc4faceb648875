"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over packed tokens, plus the heads their checkpoints carry:
sequence classification (cross-encoders), the masked-LM head (``*ForMaskedLM``; SPLADE reads its logits) and
bge-m3's ``sparse_linear`` / ``colbert_linear`` projections.

Our own implementation, checked against transformers' ``BertModel`` / ``XLMRobertaModel`` on the same weights.
The model sees flat tokens ``(T,)``, their positions within each sequence and an ``AttnMeta``; it never sees how
requests were batched. Query/key/value projections are fused into one GEMM at load time.

    >>> model = BertModel.from_hf_config(config); model.load_hf_state_dict(state_dict)
    >>> hidden = model(input_ids, positions, meta, token_type_ids)      # (T, hidden)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lab.kernels import cpu_norms
from lab.models.base import PackedModel
from lab.models.checks import check_shape
from lab.models.folder import KeyTracker, warn_unexpected
from lab.ops.attention import attention, ops
from lab.ops.batch import AttnMeta, OutputRows
from lab.ops.gemm import (
    ACTIVATIONS,
    Linear,
    activation_inplace,
    check_activation,
    linear,
    linear_act,
    row_blocks,
)
from lab.ops.plan import CpuPlan
from lab.ops.probes import Probe, attention_probe, gemm_probes

# Tokens per FFN block on the CPU row-blocked path (``BertLayer._ffn``): 512-2048 ran alike, 256 slower (measured:
# evals/README.md, "Measurements behind the code's choices").
FFN_ROWS = 1024
PROBE_ROWS = 512  # tokens per probe step (``BertModel.cpu_probes``): one worker's GEMMs, a few ms each


def _cpu_default(x: torch.Tensor, name: str, plan: CpuPlan) -> str:
    """The plan's choice for ``name`` for a step on ``x`` (``_cpu_choice``)."""
    return _cpu_choice(x.device, x.dtype, name, plan)


def _cpu_choice(device: torch.device, dtype: torch.dtype, name: str, plan: CpuPlan) -> str:
    """The plan's choice for ``name`` on CPU; without a probe, CPU float32 takes the narrow paths (``split``,
    ``blocks``) and everything else the stacked / fused ones."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return "stacked" if name == "bert_qkv" else "fused"
    narrow = "split" if name == "bert_qkv" else "blocks"
    wide = "stacked" if name == "bert_qkv" else "fused"
    return plan.get(name) or (narrow if dtype == torch.float32 else wide)


def _lab_norm(x: torch.Tensor, norm: nn.LayerNorm, meta: AttnMeta, plan: CpuPlan) -> bool:
    """Whether ``LayerNorm(x + residual)`` runs in ``lab.kernels.cpu_norms`` (in place): where the
    ``add_layer_norm`` probe chose it, the torch backend runs (``attention_backend="triton"`` keeps Triton's norms),
    the kernel takes ``x`` (CPU) and nothing records gradients (the kernel has no backward: training, e.g.
    ``lab.adapt``, runs torch's ops); elsewhere, and by default, the backend's ops."""
    return cpu_norms.chosen(plan.get("add_layer_norm"), meta.backend, x, norm.weight, norm.bias)


def add_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.LayerNorm, eps: float, meta: AttnMeta, plan: CpuPlan
) -> torch.Tensor:
    """``norm(x + residual)`` for a fresh ``x`` nothing else reads (a GEMM's output, the embeddings' sum): in
    ``lab.kernels.cpu_norms`` written over ``x`` where the plan chose it, else the backend's ``add_layer_norm``."""
    if _lab_norm(x, norm, meta, plan):
        return cpu_norms.add_layer_norm(x, residual, norm.weight, norm.bias, eps, out=x)
    return ops(meta).add_layer_norm(x, residual, norm.weight, norm.bias, eps)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act: str, index: int, plan: CpuPlan):
        super().__init__()
        self.heads, self.head_dim, self.eps, self.index = heads, hidden // heads, eps, index
        self.plan = plan  # the model's CPU plan (``PackedModel.plan``), read on every call
        self.qkv = Linear(hidden, 3 * hidden, plan=plan)  # fused query/key/value
        self.attn_out = Linear(hidden, hidden, plan=plan)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = Linear(hidden, intermediate, plan=plan)
        self.down = Linear(intermediate, hidden, plan=plan)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)
        self.act_name = act
        self.act = ACTIVATIONS[act]
        self.act_inplace = activation_inplace(act)

    def forward(self, x: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """q/k/v as one stacked GEMM or three (``bert_qkv``: ``stacked`` / ``split``, row slices of the stacked
        weight, no copies), and the FFN with its activation in the up-projection's oneDNN epilogue or in row blocks of
        ``FFN_ROWS`` tokens with the activation in place (``bert_ffn``: ``fused`` / ``blocks``). On CPU a probe
        picks each (``cpu_probes``): a float32 GEMM with K = 384 can run at a lower rate for N = 1152 / 1536 than for
        N = 384, and lower still with the GELU epilogue, so float32 may take the narrow paths (measured:
        evals/README.md, "Measurements behind the code's choices"); CUDA runs the stacked / fused ones.
        """
        t = x.shape[0]
        if _cpu_default(x, "bert_qkv", self.plan) == "split":
            n, w, b = self.heads * self.head_dim, self.qkv.weight, self.qkv.bias
            q, key, v = (
                linear(x, w[j * n : (j + 1) * n], b[j * n : (j + 1) * n], plan=self.plan).view(t, self.heads, -1)
                for j in range(3)
            )
        else:
            q, key, v = self.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)  # (T, H, D) each
        a = attention(q, key, v, meta, self.index, kernel=self.plan.get("attention_kernel", "sdpa"))
        x = add_norm(self.attn_out(a.view(t, -1)), x, self.attn_norm, self.eps, meta, self.plan)
        if _lab_norm(x, self.out_norm, meta, self.plan) and _cpu_default(x, "bert_ffn", self.plan) == "blocks":
            return self._ffn_norm_blocks(x)
        return add_norm(self._ffn(x), x, self.out_norm, self.eps, meta, self.plan)

    def _ffn_norm_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``out_norm(FFN(x) + x)`` in row blocks of ``FFN_ROWS`` tokens, each block's result written over its own
        rows of ``x`` (this layer's attention-side output, which nothing else reads; later blocks read only their
        rows), so the layer's output is ``x`` and no block is copied into an output tensor."""
        w, b = self.out_norm.weight, self.out_norm.bias
        for s in range(0, x.shape[0], FFN_ROWS):
            rows = x[s : s + FFN_ROWS]
            cpu_norms.add_layer_norm(
                linear(self._up_act(rows), self.down.weight, self.down.bias, plan=self.plan),
                rows,
                w,
                b,
                self.eps,
                out=rows,
            )
        return x

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if _cpu_default(x, "bert_ffn", self.plan) == "blocks":
            return row_blocks(x, self.down.weight, self.down.bias, FFN_ROWS, self._up_act, plan=self.plan)
        return self.down(linear_act(x, self.up.weight, self.up.bias, self.act_name, self.act, plan=self.plan))

    def _up_act(self, rows: torch.Tensor) -> torch.Tensor:
        """The FFN's up-projection of a row block, its activation in place (the ``blocks`` path)."""
        return self.act_inplace(linear(rows, self.up.weight, self.up.bias, plan=self.plan))


class BertModel(PackedModel):
    """Encoder stack; ``position_offset`` is 0 for BERT and ``pad_token_id + 1`` for RoBERTa / XLM-R. A
    ``*ForSequenceClassification`` checkpoint also loads its head as ``classifier`` (``SequenceClassificationHead``).
    """

    is_decoder = False
    default_causal = False

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.hidden_size, self.num_layers = hidden, config["num_hidden_layers"]
        self.eps = config.get("layer_norm_eps", 1e-12)
        self.model_type = config.get("model_type", "bert")
        self.position_offset = config.get("pad_token_id", 1) + 1 if self.model_type in ROBERTA_TYPES else 0
        self.max_positions = config["max_position_embeddings"] - self.position_offset
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type={config['position_embedding_type']!r} is not implemented; "
                "only 'absolute' (the setting of BERT, RoBERTa and XLM-R checkpoints)"
            )
        act = config.get("hidden_act", "gelu")
        check_activation(act)
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.type_vocab_size = config.get("type_vocab_size", 0)
        self.token_type_embeddings = nn.Embedding(max(self.type_vocab_size, 1), hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=self.eps)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, config["intermediate_size"], self.eps, act, i, self.plan)
            for i in range(self.num_layers)
        )
        # per-token heads (``token_heads``), set by ``load_hf_state_dict`` when the checkpoint has them
        self.mlm: MaskedLMHead | None = None
        self.sparse_linear: Linear | None = None
        self.colbert_linear: Linear | None = None

    @classmethod
    def from_hf_config(cls, config: dict) -> BertModel:
        return cls(config)

    # ------------------------------------------------ stages (``PackedModel.forward`` runs them in order)
    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttnMeta
    ) -> torch.Tensor:
        """Input of layer 0: word + position + token-type embeddings, LayerNorm-ed. ``(T, hidden)``."""
        x = self.word_embeddings(input_ids)  # a fresh gather: the sums below go in place
        x += self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:  # type 0 everywhere: one row broadcast instead of a gather
            x += self.token_type_embeddings.weight[0]
        else:
            x += self.token_type_embeddings(token_type_ids)
        return add_norm(x, None, self.emb_norm, self.eps, meta, self.plan)

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMeta,
        layers: range,
        residual: torch.Tensor | None = None,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Post-norm layers: each layer's output is final (no residual carried apart; transformers'
        ``hidden_states[k]`` is the output of layer k)."""
        if output_rows is not None:
            raise ValueError("BertModel computes every row (computes_output_rows is False)")
        for i in layers:
            x = self.layers[i](x, meta)
        return x, None

    def ffn_rows(self, device: torch.device, dtype: torch.dtype) -> int | None:
        """``FFN_ROWS`` where the FFN runs in row blocks (``BertLayer._ffn``: the plan's ``bert_ffn``)."""
        return FFN_ROWS if _cpu_choice(device, dtype, "bert_ffn", self.plan) == "blocks" else None

    def cpu_probes(self, dtype: torch.dtype, threads: int) -> Iterator[Probe]:
        """The GEMM implementation (bfloat16: native vs widened; float32: BLAS vs oneDNN; at the FFN's
        up-projection), then q/k/v split vs stacked and the FFN in row blocks vs with a fused epilogue
        (``BertLayer.forward``), on layer 0's weights, then the attention kernel: torch's fused one, three ops, or
        prefill-lab's own (``attention_kernel``, ``lab.ops.probes.attention_probe``), then the post-norms: torch's
        add and LayerNorm or prefill-lab's in-place kernel (``add_layer_norm``; ``lab.kernels.cpu_norms``, offered
        where the C library built)."""
        layer, t = self.layers[0], PROBE_ROWS
        x = torch.randn(t, self.hidden_size, dtype=dtype)
        yield from gemm_probes(x, layer.up.weight, layer.up.bias, threads, self.plan)
        qkv = {c: (lambda c=c: self._probe_qkv(layer, x, c)) for c in ("split", "stacked")}
        ffn = {c: (lambda c=c: self._probe_ffn(layer, x, c)) for c in ("blocks", "fused")}
        narrow = dtype == torch.float32  # the default (the first candidate): the narrow paths in float32
        yield Probe(
            "bert_qkv", (str(dtype), self.hidden_size), _ordered(qkv, "split" if narrow else "stacked"), threads
        )
        yield Probe(
            "bert_ffn",
            (str(dtype), self.hidden_size, layer.up.weight.shape[0]),
            _ordered(ffn, "blocks" if narrow else "fused"),
            threads,
        )
        yield attention_probe(dtype, layer.heads, layer.head_dim, threads)
        norm, h = layer.out_norm, torch.randn(t, self.hidden_size, dtype=dtype)
        if cpu_norms.supports(h, norm.weight, norm.bias) and cpu_norms.available():
            w, b, eps = norm.weight, norm.bias, self.eps
            yield Probe(
                "add_layer_norm",
                (str(dtype), self.hidden_size),
                {
                    "torch": lambda: ops("torch").add_layer_norm(h, x, w, b, eps),
                    "lab": lambda: cpu_norms.add_layer_norm(h, x, w, b, eps),
                },
                threads,
            )

    def _probe_qkv(self, layer: BertLayer, x: torch.Tensor, choice: str):
        self.plan["bert_qkv"] = choice
        w, b, n = layer.qkv.weight, layer.qkv.bias, self.hidden_size
        if choice == "split":
            return [linear(x, w[j * n : (j + 1) * n], b[j * n : (j + 1) * n], plan=self.plan) for j in range(3)]
        return layer.qkv(x)

    def _probe_ffn(self, layer: BertLayer, x: torch.Tensor, choice: str):
        self.plan["bert_ffn"] = choice
        return layer._ffn(x)

    # ------------------------------------------------------------------------------------------------ loading
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a transformers state dict (``bert.``/``roberta.`` prefixes accepted). ``classifier.*`` weights (a
        ``*ForSequenceClassification`` checkpoint) load the sequence-classification head as ``classifier``."""
        raw, sd = sd, KeyTracker(_strip_prefix(sd, _HF_PREFIXES), source=sd)
        shapes = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        own = {
            "word_embeddings.weight": "embeddings.word_embeddings.weight",
            "position_embeddings.weight": "embeddings.position_embeddings.weight",
            "emb_norm.weight": "embeddings.LayerNorm.weight",
            "emb_norm.bias": "embeddings.LayerNorm.bias",
        }
        new: dict[str, torch.Tensor] = {}
        for ours, theirs in own.items():
            new[ours] = _take(sd, theirs, shapes[ours])
        tt = sd.get("embeddings.token_type_embeddings.weight")
        if tt is None and self.type_vocab_size > 0:  # transformers would report it MISSING and initialize it randomly
            raise KeyError(
                f"weight 'embeddings.token_type_embeddings.weight' missing from the checkpoint, but "
                f"config.json has type_vocab_size={self.type_vocab_size}; the folder's weights are "
                "incomplete (set type_vocab_size to 0 only if the model was trained without token types)"
            )
        if tt is not None:
            check_shape(
                sd,
                "embeddings.token_type_embeddings.weight",
                tt,
                shapes["token_type_embeddings.weight"],
                "type_vocab_size, hidden_size",
            )
        new["token_type_embeddings.weight"] = (
            tt if tt is not None else torch.zeros_like(self.token_type_embeddings.weight)
        )
        h = self.hidden_size
        for i in range(self.num_layers):
            p, o = f"encoder.layer.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                part = (h, h) if kind == "weight" else (h,)  # each of query / key / value
                new[f"{o}qkv.{kind}"] = torch.cat(
                    [_take(sd, f"{p}attention.self.{n}.{kind}", part) for n in ("query", "key", "value")]
                )
                for ours, theirs in (
                    ("attn_out", "attention.output.dense"),
                    ("attn_norm", "attention.output.LayerNorm"),
                    ("up", "intermediate.dense"),
                    ("down", "output.dense"),
                    ("out_norm", "output.LayerNorm"),
                ):
                    new[f"{o}{ours}.{kind}"] = _take(sd, f"{p}{theirs}.{kind}", shapes[f"{o}{ours}.{kind}"])
        self.classifier = self.mlm = self.sparse_linear = self.colbert_linear = None
        mlm = MaskedLMHead.from_state_dict(sd, self.config)
        m3 = {name: _m3_linear(sd, name, self.hidden_size) for name in ("sparse_linear", "colbert_linear")}
        warn_unexpected(sd, self.model_type, ignore=_UNUSED_PREFIXES)
        self.load_state_dict(new, strict=True)
        dtype = self.word_embeddings.weight.dtype
        if has_classification_head(raw):
            head = SequenceClassificationHead(self.config)
            head.load_hf_state_dict(raw)
            self.classifier = head.to(dtype)
        self.mlm = None if mlm is None else mlm.to(dtype)
        self.sparse_linear, self.colbert_linear = (None if m is None else m.to(dtype) for m in m3.values())
        for head in (self.mlm, self.sparse_linear, self.colbert_linear):
            if head is not None:
                self.attach_plan(head)

    # ------------------------------------------------------------------------------------------ per-token heads
    @property
    def token_heads(self) -> tuple[str, ...]:
        """The per-token heads this checkpoint loaded (``PackedModel.token_heads``)."""
        return tuple(n for n in ("mlm", "sparse_linear", "colbert_linear") if getattr(self, n) is not None)

    def token_head(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """``mlm``: masked-LM logits ``(N, vocab)``; ``sparse_linear`` ``(N, 1)`` / ``colbert_linear`` ``(N, d)``:
        bge-m3's projections, all of hidden states ``(N, hidden)`` in the weights' dtype."""
        if name not in self.token_heads:
            raise ValueError(f"this checkpoint has no {name!r} head; it has: {', '.join(self.token_heads) or 'none'}")
        if name == "mlm":
            return self.mlm(hidden, self.word_embeddings.weight)
        return getattr(self, name)(hidden)

    def hf_linear_map(self) -> dict[str, tuple[str, slice] | None]:
        """Each transformers Linear (named as ``load_hf_state_dict`` reads it, prefixes stripped) -> our parameter
        and its rows: query/key/value are row blocks of the fused ``qkv``. LoRA adapters merge through this map
        (``lab.adapt.merge``). ``None``: a module our forward never runs (the pooler, unless a BERT classification
        head uses it)."""
        h = self.hidden_size
        out: dict[str, tuple[str, slice] | None] = {}
        for i in range(self.num_layers):
            p, o = f"encoder.layer.{i}.", f"layers.{i}."
            for j, n in enumerate(("query", "key", "value")):
                out[f"{p}attention.self.{n}"] = (o + "qkv.weight", slice(j * h, (j + 1) * h))
            out[f"{p}attention.output.dense"] = (o + "attn_out.weight", slice(None))
            out[f"{p}intermediate.dense"] = (o + "up.weight", slice(None))
            out[f"{p}output.dense"] = (o + "down.weight", slice(None))
        head = self.classifier
        bert_head = head is not None and self.model_type not in ROBERTA_TYPES
        out["pooler.dense"] = ("classifier.dense.weight", slice(None)) if bert_head else None
        if head is not None:
            names = (
                {"classifier.dense": "dense", "classifier.out_proj": "out"} if not bert_head else {"classifier": "out"}
            )
            out.update({k: (f"classifier.{v}.weight", slice(None)) for k, v in names.items()})
        return out

    @staticmethod
    def hf_module_name(name: str) -> str:
        """A transformers module name with the checkpoint / PEFT prefixes ``load_hf_state_dict`` accepts removed."""
        return next(iter(_strip_prefix({name: None}, _HF_PREFIXES)))


def _ordered(candidates: dict, first: str) -> dict:
    """``candidates`` with ``first`` (the default) first."""
    return {first: candidates[first], **{k: v for k, v in candidates.items() if k != first}}


# weights of a checkpoint our encoder never reads: the pooler (its classifier head reads it from the raw state
# dict), the heads of *ForSequenceClassification / *ForMaskedLM / pre-training checkpoints, buffers
_UNUSED_PREFIXES = ("pooler.", "classifier.", "cls.", "lm_head.", "embeddings.position_ids", "qa_outputs.")
_HF_PREFIXES = ("bert.", "roberta.", "xlm-roberta.", "model.", "encoder_model.")
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


class SequenceClassificationHead(nn.Module):
    """The head of ``*ForSequenceClassification`` over the first token of each sequence.

    BERT: ``classifier(tanh(pooler(h_cls)))``; RoBERTa / XLM-R: ``out_proj(tanh(dense(h_cls)))``.
    """

    def __init__(self, config: dict):
        super().__init__()
        hidden, labels = config["hidden_size"], config.get("num_labels") or len(config.get("id2label", {})) or 2
        self.num_labels = labels
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, labels)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> logits (B, num_labels)."""
        return self.out(torch.tanh(self.dense(cls_hidden)))

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if "classifier.out_proj.weight" in sd:  # RoBERTa-style head
            names = {"dense": "classifier.dense", "out": "classifier.out_proj"}
        elif "classifier.weight" in sd:
            names = {"dense": _first_present(sd, ("bert.pooler.dense", "pooler.dense")), "out": "classifier"}
        else:
            raise KeyError("no classification head (classifier.* weights) in this checkpoint")
        shapes = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        self.load_state_dict(
            {
                f"{ours}.{k}": _take(sd, f"{theirs}.{k}", shapes[f"{ours}.{k}"])
                for ours, theirs in names.items()
                for k in ("weight", "bias")
            }
        )


# transformers' names of a masked-LM head per layout: dense, LayerNorm, bias, decoder
_MLM_NAMES = {
    "bert": (
        "cls.predictions.transform.dense",
        "cls.predictions.transform.LayerNorm",
        "cls.predictions",
        "cls.predictions.decoder",
    ),
    "roberta": ("lm_head.dense", "lm_head.layer_norm", "lm_head", "lm_head.decoder"),
}


class MaskedLMHead(nn.Module):
    """The masked-LM head of ``BertForMaskedLM`` (``cls.predictions``) and ``RobertaForMaskedLM`` /
    ``XLMRobertaForMaskedLM`` (``lm_head``): dense -> activation (BERT: ``hidden_act``; RoBERTa: exact GELU) ->
    LayerNorm -> decoder + bias. The decoder is the word embeddings (tied, the usual case) unless the config unties
    them and the checkpoint has its own. ``(N, hidden)`` -> ``(N, vocab)`` logits."""

    def __init__(self, hidden: int, vocab: int, eps: float, act: str, own_decoder: bool):
        super().__init__()
        self.dense = Linear(hidden, hidden)
        self.plan: CpuPlan | None = None  # the model's, once it loads the head (``PackedModel.attach_plan``)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.decoder = nn.Parameter(torch.zeros(vocab, hidden)) if own_decoder else None
        self.act = ACTIVATIONS[act]

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.act(self.dense(hidden)))
        return linear(x, word_embeddings if self.decoder is None else self.decoder, self.bias, plan=self.plan)

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], config: dict) -> MaskedLMHead | None:
        """The head of a ``*ForMaskedLM`` state dict (prefixes stripped), or ``None`` when it has none."""
        layout = next((k for k, names in _MLM_NAMES.items() if f"{names[0]}.weight" in sd), None)
        if layout is None:
            return None
        dense, norm, bias, decoder = _MLM_NAMES[layout]
        tied = config.get("tie_word_embeddings", True)
        own = sd.get(f"{decoder}.weight")  # a tied checkpoint may store a copy of the word embeddings here
        if not tied and own is None:
            raise KeyError(
                f"weight '{decoder}.weight' missing from the checkpoint, but config.json unties the "
                "word embeddings (tie_word_embeddings=false): the masked-LM head has no decoder"
            )
        act = config.get("hidden_act", "gelu") if layout == "bert" else "gelu"
        head = cls(config["hidden_size"], config["vocab_size"], config.get("layer_norm_eps", 1e-12), act, not tied)
        shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        b = sd.get(f"{bias}.bias")
        b = _take(sd, f"{decoder}.bias") if b is None else b  # older checkpoints keep it on the decoder
        weights = {
            "bias": check_shape(sd, f"{bias}.bias", b, shapes["bias"], "vocab_size"),
            **{
                f"{ours}.{k}": _take(sd, f"{theirs}.{k}", shapes[f"{ours}.{k}"])
                for ours, theirs in (("dense", dense), ("norm", norm))
                for k in ("weight", "bias")
            },
        }
        if not tied:
            weights["decoder"] = check_shape(
                sd, f"{decoder}.weight", own, shapes["decoder"], "vocab_size, hidden_size"
            )
        head.load_state_dict(weights, strict=True)
        return head


def _m3_linear(sd: dict[str, torch.Tensor], name: str, hidden: int) -> Linear | None:
    """bge-m3's ``sparse_linear`` / ``colbert_linear`` (``sparse_linear.pt`` / ``colbert_linear.pt`` beside the
    weights, read under these prefixes by ``lab.models.folder.read_state_dict``), or ``None``; its input width must
    be the model's ``hidden`` size, and a bias its output width."""
    w = sd.get(f"{name}.weight")
    if w is None:
        return None
    check_shape(sd, f"{name}.weight", w, (w.shape[0] if w.dim() else 1, hidden), "(outputs, hidden_size)")
    if f"{name}.bias" in sd:
        check_shape(sd, f"{name}.bias", sd[f"{name}.bias"], (w.shape[0],), "the weight's outputs")
    layer = Linear(w.shape[1], w.shape[0], bias=f"{name}.bias" in sd)
    layer.load_state_dict({"weight": w, **({"bias": sd[f"{name}.bias"]} if layer.bias is not None else {})})
    return layer


def has_classification_head(sd_keys) -> bool:
    return any(k.startswith("classifier.") for k in sd_keys)


def _first_present(sd: dict, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if f"{p}.weight" in sd:
            return p
    raise KeyError(f"none of {', '.join(p + '.weight' for p in prefixes)} in the checkpoint")


def _strip_prefix(sd: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p) :]
                break
        out[k] = v
    return out


def _take(sd: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Checkpoint tensor ``key`` (``KeyError`` naming it when missing), checked to have ``shape`` when given."""
    try:
        t = sd[key]
    except KeyError:
        near = [k for k in sd if k.split(".")[-1] == key.split(".")[-1]][:3]
        raise KeyError(f"weight {key!r} missing from the checkpoint (similar keys: {near})") from None
    return t if shape is None else check_shape(sd, key, t, shape)
