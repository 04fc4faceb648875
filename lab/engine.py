"""``Engine``: load a model once, flip knobs live, embed / score / rerank with packed, prefill-only batches.

Every call runs one pipeline (``Engine._run``), data flowing one way: ``Pass`` (texts, how to tokenize them, a
pooler) -> ``InputProcessor`` (tokenize, instruction, truncation records; the next wave tokenized while this one
runs) -> ``Executor`` (packed path or KV path, CPU workers on both; ``lab.executor``) -> ``Pooler`` (method x head:
``lab.pooling``, ``lab.heads``) -> ``OutputBuffer`` (input order), all inside one ``Call`` (one ``Stats``, timer,
progress bar, truncation warning; ``lab.call``). ``embed`` is one pass; ``score`` builds its passes in
``lab.rerank``.

    >>> eng = Engine(path)                                  # a local HF / sentence-transformers folder
    >>> E = eng.embed(["A man plays a guitar.", "Someone plays guitar."])    # (2, 384) float32
    >>> eng.configure(pooling="cls", normalize=False)       # live, no weight reload
    >>> eng.stats                                           # sequences, tokens, batches, padded_tokens, ...
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, fields

import numpy as np
import torch

from lab import rerank as scoring
from lab.adapters import LoraAdapter, merged_weights, read_adapter, split_adapter_model
from lab.attention import resolve_backend
from lab.call import Call, ExecSettings, OutputBuffer, Pass, Stats
from lab.executor import Executor
from lab.heads import EmbeddingHead, Pooler
from lab.inputs import InputProcessor, Request, check_texts
from lab.knobs import Knobs, resolve_device, resolve_dtype
from lab.models import model_class
from lab.models.hf_fallback import HFFallbackModel
from lab.models.loading import ModelSpec, load_tokenizer, read_folder, read_state_dict
from lab.outputs import output_pooler
from lab.pooling import pooling_method
from lab.runner import Runner
from lab.runtime import tune_cpu_allocator
from lab.scheduler import WAVE_SIZE, prefetch_waves

__all__ = ["Engine", "Stats"]

_UNSET = object()


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
            layer, holding hidden states + one layer's K/V per long input (``lab.kv_path``).
        instruction: text prepended to every input, attended to; pooled or not as ``include_instruction`` says.
        include_instruction: pool the instruction's tokens too; ``None`` = the model's Pooling config
            (sentence-transformers' ``include_prompt``, which pools them unless it says false), else ``False``.
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
        include_instruction: bool | None = None,
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
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a local model folder, got {type(model).__name__}")
        model, adapters = split_adapter_model(str(model), self._knobs.adapters)  # an adapter-only folder: its base
        self._knobs = self._knobs.replace(adapters=adapters)
        self.model_path = str(model)
        self.spec: ModelSpec = read_folder(model)
        self.device = resolve_device(self._knobs.device)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.tokenizer = load_tokenizer(self.spec)
        self.model = self._build_model()
        self.runner = Runner(self.model, device=self.device, dtype=resolve_dtype(self._knobs.dtype, self.device))
        self.executor = Executor(self.runner)
        self._warned_lengths: set[int] = set()  # max_length values whose truncation this engine has warned about
        self._dirty = False  # a configure was interrupted while swapping weights (``_repair``)
        self._adapters: list[LoraAdapter] = []  # merged into the live weights, in order
        if self._knobs.adapters:
            self._adapters, merged = self._merge_adapters(self._knobs.adapters)
            self.runner.set_merged(merged)
        self._check_causal_support(self._knobs)
        self._check_layer(self._knobs)
        self._check_sizes(self._knobs)
        self.stats = Stats()
        self._backend = resolve_backend(self._knobs.attention_backend, self.device)
        self.runner.plan_cpu_paths(self._workers)

    # ----------------------------------------------------------------------------------------------- loading
    def _build_model(self):
        cls = model_class(self.spec.architecture)
        if cls is None and self.spec.config.get("auto_map"):
            raise ValueError(
                f"{self.spec.path} declares custom model code (config.json auto_map: "
                f"{sorted(self.spec.config['auto_map'])}) for {self.spec.architecture or 'an unknown architecture'}; "
                "prefill-lab never executes code from a model folder, and this architecture has no packed "
                "implementation. Use a folder of a supported architecture (BERT / RoBERTa / XLM-R, Llama / Mistral "
                "/ Qwen2 / Qwen3) or one transformers implements itself"
            )
        if cls is None:
            warnings.warn(
                f"{self.spec.architecture or 'this architecture'} has no packed implementation here; using "
                "transformers AutoModel with padded batches (see stats.path / stats.padded_tokens)",
                stacklevel=3,
            )
            return HFFallbackModel(str(self.spec.path), self.spec.config)
        try:
            model = cls.from_hf_config(self.spec.config)
        except KeyError as e:
            raise ValueError(f"{self.spec.path / 'config.json'} lacks {e.args[0]!r}, which a {self.spec.architecture} "
                             "needs; the config is incomplete") from None
        model.load_hf_state_dict(read_state_dict(self.spec))
        return model

    # ------------------------------------------------------------------------------------------------- knobs
    @property
    def knobs(self) -> dict:
        """Current knob values as set (``None`` = the model's default; see ``resolved`` for what runs)."""
        return asdict(self._knobs)

    @property
    def resolved(self) -> dict:
        """The knob values that actually run, with model defaults filled in."""
        k = self._knobs
        return {
            "pooling": self.pooling, "normalize": self.normalize, "truncate_dim": k.truncate_dim,
            "max_length": self.max_length, "causal": self.causal,
            "dtype": str(self.runner.dtype).removeprefix("torch."), "device": str(self.device),
            "attention_backend": self._backend, "chunked_prefill": k.chunked_prefill, "instruction": k.instruction,
            "include_instruction": self.include_instruction, "append_eos": self.append_eos,
            "cpu_workers": self._workers, "layer": self.layer,
            "adapters": self.adapter_names, "cpu_paths": self.cpu_paths,
        }

    @property
    def _workers(self) -> int:
        """The CPU workers a packed step is shared among under the knobs in force (``Runner.cpu_workers``)."""
        return self.runner.cpu_workers(self._knobs.cpu_workers, self._backend)

    @property
    def cpu_paths(self) -> dict[str, str]:
        """The CPU fast paths in force, decided by short probes on this machine (``lab.models.probes``): name ->
        choice, e.g. ``{"bf16_gemm": "native", "bert_qkv": "stacked", "bert_ffn": "fused"}``; ``{}`` off the CPU.
        ``lab.models.probes.decisions()`` has the timings behind them; ``LAB_CPU_<NAME>`` forces one."""
        return {d.name: d.choice for d in self.runner.decisions}

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
        if paths and not self.model.packed:
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
        self._repair()
        new = self.validate(**knobs)
        backend = resolve_backend(new.attention_backend, self.device)
        adapters = None
        if new.adapters != self._knobs.adapters:  # computed before anything is swapped: an error changes nothing
            adapters, merged = self._merge_adapters(new.adapters)
        dtype = resolve_dtype(new.dtype, self.device)
        workers = self.runner.cpu_workers(new.cpu_workers, backend)
        replan = dtype != self.runner.dtype or workers != self._workers
        self._dirty = True  # from here to the end, an interrupt is repaired by the next call (``_repair``)
        if adapters is not None:
            self.runner.set_merged(merged)
            self._adapters = adapters
        self.runner.set_dtype(dtype)
        self._knobs, self._backend = new, backend
        if replan:
            self.runner.plan_cpu_paths(workers)
        self._dirty = False
        return self

    def _repair(self) -> None:
        """After a ``configure`` interrupted while it swapped weights: make the merged adapters, the weights' dtype
        and the CPU plan agree with the knobs in force (the old ones, or the new ones if it got that far)."""
        if not self._dirty:
            return
        k = self._knobs
        adapters, merged = self._merge_adapters(k.adapters) if k.adapters else ([], {})
        self.runner.set_merged(merged)
        self._adapters = adapters
        self.runner.dtype = None  # recast every weight from its source
        self.runner.set_dtype(resolve_dtype(k.dtype, self.device))
        self.runner.plan_cpu_paths(self._workers)
        self._dirty = False

    def validate(self, **knobs) -> Knobs:
        """Check a knob change without applying it (``configure`` runs the same checks first): the new knob values,
        or ``ValueError``/``TypeError`` naming the knob, the value and the valid range. Sweeps call it on every
        variant before running any (``lab.evaluate``)."""
        if "device" in knobs and knobs["device"] != self._knobs.device:
            raise ValueError("device cannot change live (it moves every weight); create a new Engine instead")
        new = self._knobs.replace(**knobs)
        self._check_causal_support(new)
        self._check_layer(new)
        self._check_sizes(new)
        resolve_backend(new.attention_backend, self.device)
        resolve_dtype(new.dtype, self.device)
        return new

    def _check_sizes(self, k: Knobs) -> None:
        """``truncate_dim`` within the embedding size; ``max_length`` within the positions the model has (encoders;
        decoders past ``max_position_embeddings`` get a warning) and long enough for the special tokens."""
        hidden = self.model.hidden_size
        if k.truncate_dim is not None and k.truncate_dim > hidden:
            raise ValueError(f"truncate_dim={k.truncate_dim} exceeds the embedding size {hidden}; valid: 1..{hidden}")
        if k.max_length is None:
            return
        positions = self.model.max_positions or self.spec.config.get("max_position_embeddings")
        if positions and k.max_length > positions:
            if not self.model.is_decoder:
                raise ValueError(f"max_length={k.max_length} but this model has {positions} positions; valid: "
                                 f"1..{positions} (or None for the model's own limit)")
            warnings.warn(f"max_length={k.max_length} is past this decoder's max_position_embeddings={positions}: "
                          "RoPE beyond the trained length usually degrades embeddings", stacklevel=4)
        specials = len(self.tokenizer("", add_special_tokens=True)["input_ids"])
        if k.max_length <= specials:
            raise ValueError(f"max_length={k.max_length} leaves no room for text: the tokenizer adds {specials} "
                             f"special token(s) to every input; use max_length >= {specials + 1}")

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
        n = self.model.num_layers
        if n is None:
            raise ValueError(f"layer={k.layer} but this model does not report its number of layers; use layer=None")
        if not -n <= k.layer <= n:
            raise ValueError(f"layer={k.layer} but this model has {n} layers; valid: 0..{n}, -{n}..-1, or None")

    def _layer_for(self, k: Knobs) -> int | None:
        n = self.model.num_layers
        if k.layer is None:
            return n
        return n + 1 + k.layer if k.layer < 0 else k.layer  # -1 = layer n (the last), -n = layer 1

    @property
    def num_layers(self) -> int | None:
        """The model's number of layers (``None`` when a transformers-fallback config does not say)."""
        return self.model.num_layers

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
        return self.model.classifier is not None

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
        limits.append(self.model.max_positions or self.spec.config.get("max_position_embeddings"))
        return min(x for x in limits if x) if any(limits) else 512

    @property
    def model_name(self) -> str:
        return self.spec.name

    @property
    def embedding_dim(self) -> int:
        return self._knobs.truncate_dim or self.model.hidden_size

    def __repr__(self) -> str:
        r = self.resolved
        layer = "" if r["layer"] == self.model.num_layers else f"layer={r['layer']}, "
        adapters = f"adapters={r['adapters']}, " if r["adapters"] else ""
        return (
            f"Engine({self.model_name!r}, {self.spec.architecture}, pooling={r['pooling']}, "
            f"causal={r['causal']}, normalize={r['normalize']}, {layer}{adapters}dtype={r['dtype']}, "
            f"device={r['device']})"
        )

    # ------------------------------------------------------------------------------------------------- embed
    def _processor(self) -> InputProcessor:
        return InputProcessor(self.tokenizer, self.max_length, append_eos=self.append_eos)

    def _instruction(self, instruction) -> str | None:
        instr = self._knobs.instruction if instruction is _UNSET else instruction
        if instr is not None and not isinstance(instr, str):
            raise TypeError(f"instruction must be a string or None, got {type(instr).__name__}")
        return instr

    @property
    def include_instruction(self) -> bool:
        """Whether instruction tokens are pooled: the knob, else the model's Pooling config (``include_prompt``,
        as ``SentenceTransformer.encode(prompt=...)`` pools them), else ``False`` (llm2vec's embed mask)."""
        if self._knobs.include_instruction is not None:
            return self._knobs.include_instruction
        return bool(self.spec.include_prompt)

    def tokenize(self, texts: list[str], *, instruction=_UNSET) -> list[Request]:
        """The requests ``embed(texts, instruction=...)`` runs: token ids after truncation, ``pool_start`` (the
        instruction's tokens, attended to but not pooled) and whether each input was cut."""
        texts = check_texts(texts)
        return self._embed_pass(texts, self._instruction(instruction)).tokenize(texts, 0)

    def _embed_pass(self, texts: list[str], instruction: str | None, pooling: str | None = None,
                    output="dense") -> Pass:
        """The pass ``embed`` runs over ``texts`` (``pooling``: a method name, default the engine's; ``output``:
        as ``embed``'s, checked here)."""
        proc, include = self._processor(), self.include_instruction
        method = pooling_method(pooling or self.pooling)
        head = EmbeddingHead(self.model.hidden_size, truncate_dim=self._knobs.truncate_dim, normalize=self.normalize)
        pooler = output_pooler(output, Pooler(method, head), model=self.model, spec=self.spec,
                               tokenizer=self.tokenizer)

        def tokenize(chunk: list[str], first: int) -> list[Request]:
            return proc.process(chunk, first_index=first, instruction=instruction, include_instruction=include)

        return Pass(texts, tokenize, pooler, shared_prefix=bool(instruction and not include))

    def embed(self, texts: list[str], *, output="dense", instruction=_UNSET, show_progress: bool | None = None):
        """Embed ``texts``, in input order. ``output`` (``lab.outputs``):

        - ``"dense"`` (default): ``(len(texts), dim)`` float32;
        - ``"tokens"``: a list of ``(L_i, hidden)`` float32 arrays, the final hidden states of the tokens ``mean``
          pooling averages (so ``tokens[i].mean(0)`` is the mean-pooled vector before normalize);
        - ``"sparse"``: a ``scipy.sparse.csr_matrix`` ``(len(texts), vocab_size)`` float32 of lexical weights
          (SPLADE models; bge-m3's ``sparse_linear``);
        - ``"colbert"``: a list of ``(L_i - 1, d)`` float32 arrays, bge-m3's normalized ColBERT vectors;
        - a tuple of these: a dict of them by name, all from one forward per step.

        An output the model cannot give is an error naming the heads it has, raised before any work.
        ``instruction`` overrides the engine's instruction for this call (``None`` for none).
        ``show_progress``: a tqdm bar; ``None`` shows one for more than 4096 texts.
        """
        texts = check_texts(texts)
        p = self._embed_pass(texts, self._instruction(instruction), output=output)
        return self._run([p], "embed", show_progress)[0]

    # ------------------------------------------------------------------------------------------- the pipeline
    def _settings(self) -> ExecSettings:
        k = self._knobs
        return ExecSettings(causal=self.causal, backend=self._backend, workers=k.cpu_workers, num_layers=self.layer,
                            max_batch_tokens=k.max_batch_tokens, max_num_seqs=k.max_num_seqs,
                            chunked_prefill=k.chunked_prefill, prefix_cache=k.prefix_cache)

    def _run(self, passes: list[Pass], desc: str, show_progress: bool | None) -> list:
        """Run ``passes`` in one call: each pass's outputs in its input order. ``stats`` are published only when
        every pass finished (a failed or interrupted call leaves the engine, its stats included, as it was)."""
        self._repair()
        settings = self._settings()
        stats = Stats(path="packed" if self.model.packed else "transformers-fallback (padded)",
                      backend=self._backend, adapters=tuple(self.adapter_names))
        results = []
        with Call(stats, total=sum(len(p.items) for p in passes), desc=desc, show_progress=show_progress,
                  warned=self._warned_lengths, max_length=self.max_length) as call, torch.inference_mode():
            for p in passes:
                out = OutputBuffer(len(p.items), p.pooler.shape)
                for requests in prefetch_waves(p.items, p.tokenize, WAVE_SIZE):
                    for reqs, rows in self.executor.run(requests, p.pooler, settings, stats,
                                                        shared_prefix=p.shared_prefix):
                        out.place(reqs, rows)
                        call.served(reqs)
                results.append(out.result())
        self.stats = stats
        return results

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

    # ----------------------------------------------------------------------------------- score / rerank (lab.rerank)
    @property
    def score_mode(self) -> str:
        """How ``score`` / ``rerank`` score by default: ``cross-encoder``, ``llm`` or ``bi-encoder``."""
        return scoring.default_mode(self)

    def score(self, pairs, *, mode: str | None = None, activation: str | None = "default", instruction=_UNSET,
              prompt=None, similarity: str = "cosine", show_progress: bool | None = None) -> np.ndarray:
        """Scores of ``(query, document)`` pairs, in input order: ``(N,)`` float32, ``(N, num_labels)`` for a
        multi-label cross-encoder. ``mode``: ``cross-encoder`` | ``llm`` | ``bi-encoder`` (default
        ``score_mode``) | ``late-interaction`` (ColBERT MaxSim) | ``sparse`` (lexical weights) | ``m3`` (bge-m3's
        weighted dense + sparse + ColBERT); ``activation``: ``default`` (CrossEncoder.predict's; P(yes); raw
        similarity), ``None`` (raw), ``sigmoid``, ``softmax``, ``tanh``; ``prompt``: a ``lab.rerank.YesNoPrompt`` for ``llm``;
        ``similarity``: ``cosine`` or ``dot`` for ``bi-encoder``. See ``lab.rerank``."""
        job = scoring.score_job(self, pairs, mode=mode, activation=activation, instruction=self._instruction(
            instruction), prompt=prompt, similarity=similarity, embed_pass=self._embed_pass)
        return job.combine(self._run(job.passes, "score", show_progress))

    def rerank(self, query: str, documents: list[str], *, top_k: int | None = None, **score_kwargs):
        """``documents`` sorted best first for ``query``: a pandas DataFrame with ``rank``, ``index`` (into
        ``documents``), ``score``, ``document``; ``top_k`` keeps the best k. ``score_kwargs`` as in ``score``."""
        return scoring.rerank(self, query, documents, top_k=top_k, **score_kwargs)

    def similarity(self, a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """Cosine similarity matrix ``(n, m)`` between two sets of embeddings ``(n, dim)`` and ``(m, dim)``
        (``b=None``: ``a`` with itself)."""
        a = np.asarray(a, dtype=np.float32)
        b = a if b is None else np.asarray(b, dtype=np.float32)
        for name, x in (("a", a), ("b", b)):
            if x.ndim != 2:
                hint = f"; for one vector pass {name}[None]" if x.ndim == 1 else ""
                raise ValueError(f"similarity: {name} must be a 2-D array (n, dim), got shape {x.shape}{hint}")
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"similarity: a has {a.shape[1]} dimensions and b has {b.shape[1]}; they must match")
        an = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
        bn = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
        return an @ bn.T

