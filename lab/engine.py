"""``Engine``: load a model once, flip knobs live, embed / score / rerank with packed, prefill-only batches.

Data flows one way: texts -> ``InputProcessor`` (tokenize, instruction, truncation records) -> ``plan_batches``
(token budget, longest first) -> ``Runner`` (flat tokens + ``AttnMeta``, pooled by index) -> rows placed back in
input order. Tokenization of the next wave overlaps the model's work on the current one.

    >>> eng = Engine(path)                                  # a local HF / sentence-transformers folder
    >>> E = eng.embed(["A man plays a guitar.", "Someone plays guitar."])    # (2, 384) float32
    >>> eng.configure(pooling="cls", normalize=False)       # live, no weight reload
    >>> eng.stats                                           # sequences, tokens, batches, padded_tokens, ...
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from lab.adapters import LoraAdapter, merged_weights, read_adapter, split_adapter_model
from lab.attention import resolve_backend
from lab.inputs import InputProcessor, Request, check_texts
from lab.knobs import Knobs, resolve_device, resolve_dtype
from lab.models import model_class
from lab.models.loading import ModelSpec, load_tokenizer, read_folder, read_state_dict
from lab.pooling import finish
from lab.runner import Runner
from lab.runtime import tune_cpu_allocator
from lab.scheduler import plan_batches, prefetch_waves

_UNSET = object()
WAVE_SIZE = 4096  # texts tokenized per wave; the next wave is tokenized while this one runs


@dataclass
class Stats:
    """What the last call did. ``padded_tokens`` is 0 on the packed path; ``truncated`` counts inputs cut at
    ``max_length``; ``tokens`` are the tokens served, ``tokens_computed`` those run through the model (fewer when
    the prefix cache computed a shared instruction prefix, ``shared_prefix`` tokens long, once); ``chunks`` counts
    the pieces of the KV-cache path (chunked prefill / prefix cache) and ``state_bytes`` the most it held across
    steps (hidden states + one layer's K/V of the inputs in flight, plus the shared prefix's K/V; 0 elsewhere)."""

    sequences: int = 0
    tokens: int = 0
    batches: int = 0
    padded_tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    tokens_computed: int = 0
    chunks: int = 0
    shared_prefix: int = 0
    state_bytes: int = 0
    path: str = "packed"
    backend: str = "torch"
    adapters: tuple[str, ...] = ()  # names of the LoRA adapters merged into the weights that ran

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.sequences} sequences, {self.tokens} tokens in {self.batches} batches, "
            f"{self.seconds:.3f} s ({self.tokens_per_s:,.0f} tokens/s); padded {self.padded_tokens}, "
            f"truncated {self.truncated}; {self.path} / {self.backend}"
            + (f"; adapters {', '.join(self.adapters)}" if self.adapters else "")
        )


class Engine:
    """A prefill-only engine over one model folder. Every knob but ``model`` and ``device`` is live.

    Args:
        model: a local model folder (transformers / sentence-transformers layout) or a ``.gguf`` file; or a PEFT
            adapter folder whose ``base_model_name_or_path`` is a local folder (that base loads, the adapter first
            in ``adapters``).
        pooling: ``cls``, ``mean``, ``max``, ``lasttoken`` or ``weightedmean``; ``None`` = the model's own
            (sentence-transformers Pooling config; ``lasttoken`` for decoders; else ``mean``).
        normalize: L2-normalize embeddings; ``None`` = whether the model folder has a Normalize module.
        truncate_dim: matryoshka dimension (applied before normalize).
        max_length: longest input in tokens (longer ones are truncated and counted in ``stats.truncated``);
            ``None`` = sentence_bert_config's ``max_seq_length``, else the tokenizer's / model's limit.
        max_batch_tokens, max_num_seqs: the scheduler's budget per packed step.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` (fixed at load).
        bidirectional: ``None`` = the model's own attention; ``True``/``False`` override (LLM2Vec-style).
        chunked_prefill: tokens per chunk for long inputs under causal attention (``None`` = off); runs layer by
            layer, holding hidden states + one layer's K/V per long input (``lab.chunking``).
        instruction: text prepended to every input, attended to but not pooled unless ``include_instruction``.
        append_eos: append EOS when the tokenizer does not (``None`` = on for decoders with lasttoken pooling).
        prefix_cache: reuse the shared instruction prefix's K/V under causal attention.
        attention_backend: ``auto`` (triton on CUDA, torch on CPU), ``torch`` or ``triton``.
        cpu_workers: on CPU, split each packed step across this many worker threads, each running its share of
            the sequences with ``torch.get_num_threads() // cpu_workers`` intra-op threads (``None`` = one worker
            per intra-op thread; ``1`` = the whole step on all threads). See ``lab.runner``.
        layer: pool the hidden states after this layer, running only the layers up to it (a shorter forward, not a
            slice of the full one): 1-based, ``0`` = the embedding output, negative counts from the end (``-1`` =
            the last), ``None`` = the last. Equals transformers' ``output_hidden_states=True`` ->
            ``hidden_states[layer]``. Decoders (pre-norm): the final RMSNorm is applied only at the last layer, as
            in transformers (below it, the un-normed residual stream); encoders (post-norm): each layer's output.
        adapters: PEFT LoRA folders (``adapter_config.json`` + ``adapter_model.safetensors``) merged into the
            weights in this order, each on top of the last (``lab.adapters``); live: ``configure(adapters=[...])``
            re-merges from the float32 master copy and ``[]`` restores the base weights exactly. Packed models
            only; DoRA, trained biases and LoRA on embeddings / ``lm_head`` are refused.
    """

    def __init__(
        self,
        model: str,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        truncate_dim: int | None = None,
        max_length: int | None = None,
        max_batch_tokens: int = 16384,
        max_num_seqs: int = 256,
        dtype: str = "auto",
        device: str = "auto",
        bidirectional: bool | None = None,
        chunked_prefill: int | None = None,
        instruction: str | None = None,
        include_instruction: bool = False,
        append_eos: bool | None = None,
        prefix_cache: bool = True,
        attention_backend: str = "auto",
        cpu_workers: int | None = None,
        adapters: list[str] | tuple[str, ...] = (),
        layer: int | None = None,
    ):
        args = locals()  # every knob is a keyword argument of the same name (a KeyError here says which is not)
        knobs = {f.name: args[f.name] for f in fields(Knobs)}
        self._knobs = Knobs().replace(**knobs)
        if not isinstance(model, (str,)) and not hasattr(model, "__fspath__"):
            raise TypeError(f"model must be a path to a local model folder, got {type(model).__name__}")
        model, adapters = split_adapter_model(str(model), self._knobs.adapters)  # an adapter-only folder: its base
        self._knobs = self._knobs.replace(adapters=adapters)
        self.model_path = str(model)
        self.spec: ModelSpec = read_folder(model)
        self.device = resolve_device(self._knobs.device)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.tokenizer = load_tokenizer(self.spec)
        self.model, self.head = self._build_model()
        self.runner = Runner(self.model, device=self.device, dtype=resolve_dtype(self._knobs.dtype, self.device))
        self._adapters: list[LoraAdapter] = []  # merged into the live weights, in order
        if self._knobs.adapters:
            self._adapters, merged = self._merge_adapters(self._knobs.adapters)
            self.runner.set_merged(merged)
        self._check_causal_support(self._knobs)
        self._check_layer(self._knobs)
        self.stats = Stats()
        self._backend = resolve_backend(self._knobs.attention_backend, self.device)

    # ----------------------------------------------------------------------------------------------- loading
    def _build_model(self):
        cls = model_class(self.spec.architecture)
        head = None
        if cls is None:
            from lab.models.hf_fallback import HFFallbackModel

            warnings.warn(
                f"{self.spec.architecture or 'this architecture'} has no packed implementation here; using "
                "transformers AutoModel with padded batches (see stats.path / stats.padded_tokens)",
                stacklevel=3,
            )
            return HFFallbackModel(str(self.spec.path), self.spec.config), None
        model = cls.from_hf_config(self.spec.config)
        sd = read_state_dict(self.spec)
        model.load_hf_state_dict(sd)
        from lab.models.bert import SequenceClassificationHead, has_classification_head

        if not model.is_decoder and has_classification_head(sd):
            head = SequenceClassificationHead(self.spec.config)
            head.load_hf_state_dict(sd)
        model.classification_head = head  # registered as a submodule: cast and moved with the model
        return model, head

    # ------------------------------------------------------------------------------------------------- knobs
    @property
    def knobs(self) -> dict:
        """Current knob values as set (``None`` = the model's default; see ``resolved`` for what runs)."""
        return asdict(self._knobs)

    @property
    def resolved(self) -> dict:
        """The knob values that actually run, with model defaults filled in."""
        return dict(
            pooling=self.pooling, normalize=self.normalize, truncate_dim=self._knobs.truncate_dim,
            max_length=self.max_length, causal=self.causal, dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.device), attention_backend=self._backend, chunked_prefill=self._knobs.chunked_prefill,
            instruction=self._knobs.instruction, append_eos=self.append_eos,
            cpu_workers=self.runner.cpu_workers(self._knobs.cpu_workers, self._backend),
            layer=self.layer, adapters=self.adapter_names,
        )

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters merged into the weights, in order (folder names; see ``adapter_ids``)."""
        return [a.name for a in self._adapters]

    @property
    def adapter_ids(self) -> list[str]:
        """``name-<content hash>`` of each merged adapter: two folders with one name (or one folder retrained)
        differ. MTEB results are cached apart by these."""
        return [a.id for a in self._adapters]

    def _merge_adapters(self, paths: tuple[str, ...]):
        """Read and check ``paths`` and merge them over the base weights: ``(adapters, {parameter: float32})``.
        Changes nothing: the caller swaps the result in (``Runner.set_merged``)."""
        if paths and hasattr(self.model, "hf"):
            raise ValueError(
                f"adapters need a packed model, but {self.spec.architecture or 'this architecture'} runs through the "
                "transformers fallback (no packed implementation here). Merge the adapter with peft "
                "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(out)) and load that folder"
            )
        adapters = [read_adapter(p) for p in paths]
        return adapters, merged_weights(self.model, self.runner.base_weights, adapters)

    def configure(self, **knobs) -> Engine:
        """Change knobs live (no weight reload; ``dtype`` re-casts from the master copy, ``adapters`` re-merge
        onto it when the list changes). Returns ``self``.

        Raises ``ValueError``/``TypeError`` naming the knob and its valid values; on error nothing changes.
        """
        if "device" in knobs and knobs["device"] != self._knobs.device:
            raise ValueError("device cannot change live (it moves every weight); create a new Engine instead")
        new = self._knobs.replace(**knobs)
        self._check_causal_support(new)
        self._check_layer(new)
        backend = resolve_backend(new.attention_backend, self.device)
        adapters = None
        if new.adapters != self._knobs.adapters:  # computed before anything is swapped: an error changes nothing
            adapters, merged = self._merge_adapters(new.adapters)
        dtype = resolve_dtype(new.dtype, self.device)
        if adapters is not None:
            self.runner.set_merged(merged)
            self._adapters = adapters
        self.runner.set_dtype(dtype)
        self._knobs, self._backend = new, backend
        return self

    def _check_causal_support(self, k: Knobs) -> None:
        causal = self._causal_for(k)
        if k.chunked_prefill is not None and not causal:
            raise ValueError(
                "chunked_prefill needs causal attention, but this model runs bidirectionally: bidirectional "
                "attention needs the whole sequence at once. Set bidirectional=False or chunked_prefill=None"
            )

    def _check_layer(self, k: Knobs) -> None:
        """``layer`` within the model's layers (its type is checked by ``Knobs``)."""
        if k.layer is None:
            return
        n = getattr(self.model, "num_layers", None)
        if n is None:
            raise ValueError(f"layer={k.layer} but this model does not report its number of layers; use layer=None")
        if not -n <= k.layer <= n:
            raise ValueError(f"layer={k.layer} but this model has {n} layers; valid: 0..{n}, -{n}..-1, or None")

    def _layer_for(self, k: Knobs) -> int | None:
        n = getattr(self.model, "num_layers", None)
        if k.layer is None:
            return n
        return n + 1 + k.layer if k.layer < 0 else k.layer  # -1 = layer n (the last), -n = layer 1

    @property
    def layer(self) -> int | None:
        """The layer whose hidden states are pooled, as the number of layers that run (``0`` = the embeddings)."""
        return self._layer_for(self._knobs)

    def _causal_for(self, k: Knobs) -> bool:
        return (not k.bidirectional) if k.bidirectional is not None else self.model.default_causal

    @property
    def is_decoder(self) -> bool:
        return bool(self.model.is_decoder)

    @property
    def is_cross_encoder(self) -> bool:
        return self.head is not None

    @property
    def causal(self) -> bool:
        return self._causal_for(self._knobs)

    @property
    def pooling(self) -> str:
        if self._knobs.pooling is not None:
            return self._knobs.pooling
        if self.spec.pooling is not None:
            return self.spec.pooling
        return "lasttoken" if self.is_decoder else "mean"

    @property
    def normalize(self) -> bool:
        return self.spec.normalize if self._knobs.normalize is None else self._knobs.normalize

    @property
    def append_eos(self) -> bool:
        if self._knobs.append_eos is not None:
            return self._knobs.append_eos
        return self.is_decoder and self.pooling == "lasttoken"

    @property
    def max_length(self) -> int:
        if self._knobs.max_length is not None:
            return self._knobs.max_length
        limits = [self.spec.max_seq_length]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if tok_max and tok_max < 1_000_000:
            limits.append(tok_max)
        limits.append(getattr(self.model, "max_positions", None) or self.spec.config.get("max_position_embeddings"))
        return min(x for x in limits if x) if any(limits) else 512

    @property
    def model_name(self) -> str:
        return self.spec.name

    @property
    def embedding_dim(self) -> int:
        return self._knobs.truncate_dim or self.model.hidden_size

    def __repr__(self) -> str:
        r = self.resolved
        layer = "" if r["layer"] == getattr(self.model, "num_layers", None) else f"layer={r['layer']}, "
        adapters = f"adapters={r['adapters']}, " if r["adapters"] else ""
        return (
            f"Engine({self.model_name!r}, {self.spec.architecture}, pooling={r['pooling']}, "
            f"causal={r['causal']}, normalize={r['normalize']}, {layer}{adapters}dtype={r['dtype']}, "
            f"device={r['device']})"
        )

    # ------------------------------------------------------------------------------------------------- embed
    def _processor(self) -> InputProcessor:
        return InputProcessor(self.tokenizer, self.max_length, append_eos=self.append_eos)

    def embed(self, texts: list[str], *, instruction=_UNSET, show_progress: bool | None = None) -> np.ndarray:
        """Embed ``texts`` -> ``(len(texts), dim)`` float32, in input order.

        ``instruction`` overrides the engine's instruction for this call (``None`` for none).
        ``show_progress``: a tqdm bar; ``None`` shows one for more than 4096 texts.
        """
        texts = check_texts(texts)
        k = self._knobs
        instr = k.instruction if instruction is _UNSET else instruction
        if instr is not None and not isinstance(instr, str):
            raise TypeError(f"instruction must be a string or None, got {type(instr).__name__}")
        proc = self._processor()

        def tokenize(chunk: list[str], first: int) -> list[Request]:
            return proc.process(chunk, first_index=first, instruction=instr,
                                include_instruction=k.include_instruction)

        out = np.empty((len(texts), self.embedding_dim), dtype=np.float32)
        stats = self._new_stats()
        t0 = time.perf_counter()
        bar = _progress(len(texts), show_progress, "embed")
        kv_path = self._uses_kv_cache(shared_prefix=bool(instr and not k.include_instruction))
        for requests in prefetch_waves(texts, tokenize, WAVE_SIZE):
            if kv_path:
                self._place(out, requests, self._cached_prefill(requests, self.pooling, stats), stats, bar)
                continue
            for batch, pooled in self._packed_batches(requests, self.pooling, stats):
                self._place(out, batch, pooled, stats, bar)
        self._finish_call(stats, t0, bar)
        return out

    def _new_stats(self) -> Stats:
        return Stats(path="packed" if not hasattr(self.model, "hf") else "transformers-fallback (padded)",
                     backend=self._backend, adapters=tuple(self.adapter_names))

    def _finish_call(self, stats: Stats, t0: float, bar) -> None:
        """Close the progress bar, time the call, publish ``stats`` and warn (once) about truncation."""
        if bar is not None:
            bar.close()
        stats.seconds = time.perf_counter() - t0
        stats.tokens_per_s = stats.tokens / stats.seconds if stats.seconds > 0 else 0.0
        self.stats = stats
        _warn_truncation(stats.truncated, self.max_length)

    # ------------------------------------------------------------------------------------------------ studies
    def as_mteb_model(self, **kwargs):
        """This engine as an mteb 2.x encoder (or cross-encoder) model; knob values name the variant.
        Keyword arguments go to ``lab.mteb_adapter.as_mteb_model`` (instructions, name, revision, ...)."""
        from lab.mteb_adapter import as_mteb_model

        return as_mteb_model(self, **kwargs)

    def panel(self):
        """An ipywidgets panel over ``configure``: knobs, sentences, Run -> similarity heatmap and stats."""
        from lab.panel import build_panel

        return build_panel(self)

    def _uses_kv_cache(self, *, shared_prefix: bool) -> bool:
        """Causal attention with chunked prefill, or with a prefix the inputs share (``shared_prefix``: an
        unpooled instruction, a prompt template) that the prefix cache computes once."""
        k = self._knobs
        if not self.causal or hasattr(self.model, "hf"):
            return False
        return k.chunked_prefill is not None or (k.prefix_cache and shared_prefix)

    def _packed_batches(self, requests: list[Request], pooling: str, stats: Stats):
        """Token-budget batches through the runner: yields ``(batch, pooled (B, hidden) float32)``, counting the
        batches, padding and computed tokens in ``stats``."""
        k = self._knobs
        for batch in plan_batches(requests, k.max_batch_tokens, k.max_num_seqs):
            pooled = self.runner.embed_batch(batch, causal=self.causal, backend=self._backend, pooling=pooling,
                                             workers=k.cpu_workers, num_layers=self.layer)
            stats.batches += 1
            stats.padded_tokens += self.runner.padded_tokens
            stats.tokens_computed += sum(r.length for r in batch)
            yield batch, pooled

    def _cached_prefill(self, requests: list[Request], pooling: str, stats: Stats) -> torch.Tensor:
        """Chunked prefill / prefix cache (``lab.chunking``): pooled ``(B, hidden)`` float32 in request order,
        with its steps, pieces, computed tokens and shared prefix counted in ``stats``."""
        from lab.chunking import CausalPrefill

        k = self._knobs
        prefill = CausalPrefill(self.runner, chunk=k.chunked_prefill, budget=k.max_batch_tokens,
                                max_seqs=k.max_num_seqs, backend=self._backend, pooling=pooling,
                                num_layers=self.layer)
        rows, pst = prefill.run(requests, shared_prefix=k.prefix_cache)
        stats.batches += pst.steps
        stats.chunks += pst.pieces
        stats.tokens_computed += pst.tokens_computed
        stats.shared_prefix = max(stats.shared_prefix, pst.shared_prefix)
        stats.state_bytes = max(stats.state_bytes, pst.state_bytes)
        return torch.stack([rows[r.index] for r in requests])

    def _place(self, out: np.ndarray, requests: list[Request], pooled, stats: Stats, bar) -> None:
        """Finish (matryoshka, normalize) and write rows back at their input positions; count what ran."""
        pooled = finish(pooled, truncate_dim=self._knobs.truncate_dim, normalize=self.normalize)
        out[[r.index for r in requests]] = pooled.cpu().numpy()
        count_served(stats, requests, bar)

    # ----------------------------------------------------------------------------------- score / rerank (lab.rerank)
    @property
    def score_mode(self) -> str:
        """How ``score`` / ``rerank`` score by default: ``cross-encoder``, ``llm`` or ``bi-encoder``."""
        from lab.rerank import default_mode

        return default_mode(self)

    def score(self, pairs, *, mode: str | None = None, activation: str | None = "default", instruction=_UNSET,
              prompt=None, similarity: str = "cosine", show_progress: bool | None = None) -> np.ndarray:
        """Scores of ``(query, document)`` pairs, in input order: ``(N,)`` float32, ``(N, num_labels)`` for a
        multi-label cross-encoder. ``mode``: ``cross-encoder`` | ``llm`` | ``bi-encoder`` (default
        ``score_mode``); ``activation``: ``default`` (CrossEncoder.predict's; P(yes); raw similarity), ``None``
        (raw), ``sigmoid``, ``softmax``, ``tanh``; ``prompt``: a ``lab.rerank.YesNoPrompt`` for ``llm``;
        ``similarity``: ``cosine`` or ``dot`` for ``bi-encoder``. See ``lab.rerank``."""
        from lab.rerank import score_pairs

        return score_pairs(self, pairs, mode=mode, activation=activation, instruction=instruction, prompt=prompt,
                           similarity=similarity, show_progress=show_progress)

    def rerank(self, query: str, documents: list[str], *, top_k: int | None = None, **score_kwargs):
        """``documents`` sorted best first for ``query``: a pandas DataFrame with ``rank``, ``index`` (into
        ``documents``), ``score``, ``document``; ``top_k`` keeps the best k. ``score_kwargs`` as in ``score``."""
        from lab.rerank import rerank

        return rerank(self, query, documents, top_k=top_k, **score_kwargs)

    def similarity(self, a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """Cosine similarity matrix between two sets of embeddings (``b=None``: ``a`` with itself)."""
        a = np.asarray(a, dtype=np.float32)
        b = a if b is None else np.asarray(b, dtype=np.float32)
        an = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
        bn = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
        return an @ bn.T


_warned_truncation: set[int] = set()


def _warn_truncation(n: int, max_length: int) -> None:
    """Say once per max_length that inputs were cut (the count is always in ``stats.truncated``)."""
    if n and max_length not in _warned_truncation:
        _warned_truncation.add(max_length)
        warnings.warn(
            f"{n} input(s) were longer than max_length={max_length} tokens and were truncated (counted in "
            "stats.truncated; this warning is shown once per max_length)",
            stacklevel=3,
        )


def _progress(total: int, show: bool | None, desc: str):
    if show is None:
        show = total > WAVE_SIZE
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="text")


def count_served(stats: Stats, requests: list[Request], bar) -> None:
    """Count served sequences, tokens and truncated inputs in ``stats``; advance the progress bar."""
    stats.sequences += len(requests)
    stats.tokens += sum(r.length for r in requests)
    stats.truncated += sum(r.truncated for r in requests)
    if bar is not None:
        bar.update(len(requests))
