"""``Engine``: load a model once, flip knobs live, embed / score / rerank with packed, prefill-only batches.

Every call runs one pipeline (``Engine.run_passes``), data flowing one way: ``Pass`` (texts, how to tokenize them, a
pooler) -> ``InputProcessor`` (tokenize, instruction, truncation records; the next wave tokenized while this one
runs) -> ``Executor`` (packed path or KV path, CPU workers on both; ``lab.engine.executor``) -> ``Pooler`` (method x
head: ``lab.outputs.pooling``, ``lab.outputs.heads``) -> ``OutputBuffer`` (input order), all inside one ``Call`` (one
``Stats``, timer, progress bar, truncation warning; ``lab.engine.call``). ``embed`` is one pass; ``score`` builds its
passes in ``lab.engine.rerank``, ``encode`` in ``lab.engine.st_encode``, both on the engine's public seam, built
in ``lab.engine.passes``: ``embed_pass`` (the pass ``embed`` runs, with another pooling or head if asked) and
``run_passes`` (passes run as one call). What the knobs come to on this model is one frozen record, ``eng.resolved``
(``lab.engine.knobs.resolve``: each value and where it came from), which every part reads; the adapters in force and
llm2vec's reading of the folders are ``lab.engine.adapter_state``'s; what a new engine loads is ``lab.engine.load``'s.

    >>> eng = Engine("sentence-transformers/all-MiniLM-L6-v2")   # a hub id, or a local folder
    >>> E = eng.embed(["A man plays a guitar.", "Someone plays guitar."])    # (2, 384) float32
    >>> eng.configure(pooling="cls", normalize=False)       # live, no weight reload
    >>> eng.stats                                           # sequences, tokens, batches, padded_tokens, ...
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lab.engine import llm2vec, rerank, windows
from lab.engine import passes as build
from lab.engine import st_encode as st_compat
from lab.engine.call import Pass, Stats
from lab.engine.executor import Executor
from lab.engine.gate import Gate
from lab.engine.inputs import Request, check_inputs, check_texts
from lab.engine.knob_registry import knob_docs, knob_signature
from lab.engine.knobs import Knobs, Resolved, resolve
from lab.engine.live import LiveState, gated_call, gated_change
from lab.engine.load import load
from lab.models import hub
from lab.outputs import multivector
from lab.outputs.quantize import quantize_output
from lab.outputs.scoring import cosine_matrix

__all__ = ["Engine", "Stats"]

_UNSET = object()


class Engine:
    """A prefill-only engine over one model folder. Every knob but ``device`` and ``revision`` is live.

        >>> eng = Engine("sentence-transformers/all-MiniLM-L6-v2", pooling="mean")   # a hub id, a folder, a .gguf
        >>> E = eng.embed(["a text", "another"])            # (2, dim) float32, input order
        >>> eng.configure(pooling="cls", truncate_dim=128)   # live, no weight reload

    Args:
        model: a hub id (``"org/name"``, its ``revision`` knob a branch, tag or commit; resolved through
            huggingface_hub's cache, fetching only the files the Engine reads: ``lab.models.hub``), or a local model
            folder (transformers / sentence-transformers layout; a local path wins over an id of the same spelling)
            or a ``.gguf`` file; or a PEFT adapter folder or repository without model weights (adapter alone, or
            LLM2Vec's ``-mntp`` layout with ``config.json`` and tokenizer) whose ``base_model_name_or_path`` is found
            (``lab.adapt.adapters.resolve_base``: absolute, relative to the adapter folder or the current directory,
            or a hub id): that base loads, the adapter first in ``adapters``. ``llm2vec_config.json`` in the model
            folder or an adapter folder sets knob defaults (``resolved.defaults``).
        tune_allocator: on CPU, apply ``lab.runtime.allocator``'s glibc malloc settings to the whole process, for good
            (freed activations stay in the heap: no page faults, but the peak heap is kept); ``None``: as
            ``LAB_MALLOC_TUNING`` says. ``resolved.malloc_tuning`` says whether they are in effect.
        cpu_paths: CPU fast-path choices forced for this engine alone, name -> choice (``{"f32_gemm": "onednn"}``;
            ``lab.ops.probes.CANDIDATES``); the others are probed on this machine.
        compile: the packed forward through ``torch.compile`` (``lab.runtime.compiled``): always, never, or (``None``)
            where it pays back and measures faster here (``lab.runtime.planner.forward_choice``).
        These three are fixed for the engine's life.

    Every other argument is a knob (``lab.engine.knob_registry.KNOBS``, listed below, in the signature and in the
    README's knob table).

    Call kinds are built on two public methods (the seam ``lab.engine.rerank`` and ``lab.engine.st_encode`` use):
    ``embed_pass`` builds a ``Pass`` of texts as ``embed`` tokenizes and pools them, and ``run_passes`` runs passes
    as one call (one ``Stats``, published when every pass finished) and returns their outputs in input order.
    """

    def __init__(
        self,
        model: str,
        *,
        cpu_paths: dict[str, str] | None = None,
        tune_allocator: bool | None = None,
        compile: bool | None = None,
        **knobs,
    ):
        k = Knobs().replace(**knobs)  # an unknown knob or a bad value is named before anything loads
        parts = load(model, k, cpu_paths=cpu_paths, tune_allocator=tune_allocator, compile=compile)
        self._source, self._facts, self._adapters = parts.source, parts.facts, parts.adapters
        self.model_path, self.spec, self.device = parts.model_path, parts.spec, parts.device
        self.tokenizer, self.model, self.runner = parts.tokenizer, parts.model, parts.runner
        self.executor = Executor(self.runner)
        self._gate = Gate()  # one call at a time, configure between calls (lab.engine.gate)
        self._warned_lengths: set = set()  # the max_length values whose truncations / splits it has warned about
        self._live = LiveState(parts.knobs, self.runner, self._adapters, self._facts, self.device)  # knobs, weights
        self.stats = Stats()
        llm2vec.notice(self.model_name, self.llm2vec, self.resolved)

    # ------------------------------------------------------------------------------------------------- knobs
    @property
    def knobs(self) -> dict:
        """Current knob values as set (``None`` = the model's default; see ``resolved`` for what runs)."""
        return dict(self._knobs)

    @property
    def resolved(self) -> Resolved:
        """What the knobs come to on this model (``lab.engine.knobs.resolve``: a frozen ``Resolved``; ``sources``
        says where each value the model decides came from, ``defaults`` the model's own), with the runtime's dtype,
        device, backend, workers, adapters, CPU paths and ``malloc_tuning``."""
        return resolve(self._knobs, self._facts, self.llm2vec, self._live.runtime(self._instruction()))

    @property
    def _knobs(self) -> Knobs:
        return self._live.knobs

    @property
    def cpu_paths(self) -> dict[str, str]:
        """This engine's CPU fast paths, name -> choice (``{"rope_layout": "pairs", ...}``; ``{}`` off the CPU), probed
        on this machine or forced (``cpu_paths=``, ``LAB_CPU_<NAME>``); ``runner.decisions`` says how each was made.
        ``forward`` (``eager`` / ``compiled``) appears once a call has decided it."""
        return self._live.cpu_paths

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters merged into the weights, in order (folder names; see ``adapter_ids``)."""
        return self._adapters.names

    @property
    def adapter_ids(self) -> list[str]:
        """``name-<content hash>`` of each merged adapter: two folders with one name (or one folder retrained)
        differ. MTEB results are cached apart by these."""
        return self._adapters.ids

    @gated_change
    def configure(self, **knobs) -> Engine:
        """Change knobs live (no weight reload; ``dtype`` re-casts from the master copy, ``adapters`` re-merge onto
        it); ``self``. A bad value raises ``ValueError`` / ``TypeError`` naming it and changes nothing
        (``lab.engine.live``)."""
        self._live.repair()
        self._live.change(self.validate(**knobs))
        return self

    def validate(self, **knobs) -> Knobs:
        """Check a knob change without applying it (``configure`` runs the same checks first): the new knob values,
        or ``ValueError``/``TypeError`` naming the knob, the value and the valid range. Sweeps call it on every
        variant before running any (``lab.evaluate``)."""
        return self._live.validate(knobs, self.model_name)

    @property
    def num_layers(self) -> int | None:
        """The model's number of layers (``None`` when a transformers-fallback config does not say)."""
        return self.model.num_layers

    @property
    def is_decoder(self) -> bool:
        return bool(self.model.is_decoder)

    @property
    def is_cross_encoder(self) -> bool:
        return self.model.classifier is not None

    @property
    def llm2vec(self) -> llm2vec.Layout:
        """llm2vec's reading of the model folder and the adapters in force (``lab.engine.llm2vec.Layout``): whether
        they are an LLM2Vec layout and by what, the folder its settings come from, the name its chat template is
        chosen by."""
        return self._adapters.layout(self._knobs.adapters)

    @property
    def model_name(self) -> str:
        """What was loaded, by name: the hub id (also for a hub cache snapshot folder given as a path), else
        ``local/<folder name>``. MTEB results and benchmark rows are filed under it."""
        return self._source.name

    @property
    def revision(self) -> str:
        """The loaded snapshot's commit (a hub id, or a snapshot folder given as a path); for another local folder,
        ``local-`` + a content hash of its config and weights (``lab.models.hub.content_revision``)."""
        if self._source.revision is None:
            self._source = dataclasses.replace(self._source, revision=hub.content_revision(self._source.folder))
        return self._source.revision

    @property
    def reference(self) -> str | None:
        """The model's hub page (``https://huggingface.co/<id>``), ``None`` for a local folder."""
        return self._source.reference

    @property
    def embedding_dim(self) -> int:
        return self._knobs.truncate_dim or self.model.hidden_size

    def __repr__(self) -> str:
        r = self.resolved
        layer = "" if r.layer == self.model.num_layers else f"layer={r.layer}, "
        adapters = f"adapters={r.adapters}, " if r.adapters else ""
        return (
            f"Engine({self.model_name!r}, revision={self.revision[:12]!r}, {self.spec.architecture}, pooling="
            f"{r.pooling}, causal={r.causal}, normalize={r.normalize}, {layer}{adapters}dtype={r.dtype}, "
            f"device={r.device})"
        )

    # ------------------------------------------------------------------------------------------------- embed
    def _instruction(self, instruction=_UNSET, prompt_name: str | None = None) -> str | None:
        """The call's instruction (``lab.engine.st_encode.call_instruction``)."""
        return st_compat.call_instruction(
            self.spec, self._knobs.instruction, instruction, prompt_name, given=instruction is not _UNSET
        )

    @property
    def prompts(self) -> dict[str, str]:
        """The prompts ``prompt_name=`` names: sentence-transformers' empty ``query`` / ``document`` updated with
        the model folder's (``config_sentence_transformers.json``)."""
        return dict(self.spec.prompts)

    def cut_documents(self, texts: list[str]) -> list[str]:
        """``texts`` after llm2vec's document cut (the ``doc_max_length`` in force; ``lab.engine.llm2vec``), the same
        list when the cut is off. Every call kind's texts pass here before they are framed and tokenized."""
        r = self.resolved
        limit = r.doc_max_length
        return llm2vec.cut_documents(self.tokenizer, texts, r.max_length, limit) if limit and texts else texts

    @gated_call
    def tokenize(self, texts: list[str], *, instruction=_UNSET, prompt_name: str | None = None) -> list[Request]:
        """The requests ``embed(texts, instruction=...)`` runs: token ids after truncation, ``pool_start`` (the
        instruction's tokens, attended to but not pooled) and whether each input was cut."""
        texts, instructions = check_inputs(texts)
        return self.embed_pass(texts, self._instruction(instruction, prompt_name), instructions=instructions).tokenize(
            texts, 0
        )

    embed_pass = build.embed_pass  # the pass embed runs, for run_passes (lab.engine.passes.embed_pass)

    @gated_call
    def embed(
        self,
        texts: list[str],
        *,
        output="dense",
        instruction=_UNSET,
        prompt_name: str | None = None,
        precision: str = "float32",
        show_progress: bool | None = None,
    ):
        """Embed ``texts``, in input order. ``output`` (``lab.outputs.kinds``):

        - ``"dense"`` (default): ``(len(texts), dim)`` float32;
        - ``"tokens"``: a list of ``(L_i, hidden)`` float32 arrays, the final hidden states of the tokens ``mean``
          pooling averages (so ``tokens[i].mean(0)`` is the mean-pooled vector before normalize);
        - ``"sparse"``: a ``scipy.sparse.csr_matrix`` ``(len(texts), vocab_size)`` float32 of lexical weights
          (SPLADE models; bge-m3's ``sparse_linear``);
        - ``"colbert"``: a list of ``(L_i - 1, d)`` float32 arrays, bge-m3's normalized ColBERT vectors; from a
          ColBERT folder (``lab.outputs.multivector``) its vectors, ``prompt_name`` ``query`` / ``document`` the task;
        - a tuple of these: a dict of them by name, all from one forward per step.

        An output the model cannot give is an error naming the heads it has, raised before any work.
        ``texts`` may also be llm2vec's ``[instruction, text]`` pairs, each with its own instruction (replacing the
        call's), pooled as ``instruction_pooling`` says.
        ``instruction`` overrides the engine's instruction for this call (``None`` for none); ``prompt_name``
        uses one of the model folder's prompts instead (``prompts``; with neither and no ``instruction`` knob, its
        ``default_prompt_name``'s). ``precision``: ``float32``, or ``int8`` / ``uint8`` / ``binary`` /
        ``ubinary`` as ``lab.outputs.quantize.quantize_embeddings`` (sentence-transformers' rules; int8 ranges from
        this call's own vectors, shared by all of a list's matrices) for dense, token and ColBERT vectors.
        ``show_progress``: a tqdm bar; ``None`` shows one for more than 4096 texts.
        """
        texts, instructions = check_inputs(texts)
        build.check_embed(
            len(texts), output, precision, self._knobs.long_inputs, per_item_instructions=instructions is not None
        )
        instruction = self._instruction(instruction, prompt_name)
        if self._knobs.long_inputs == "chunk":  # windows pooled, averaged per input, then the head
            dense = windows.dense_pass(self, texts, instruction)
            out = dense.finish(self.run_passes([dense.run], "embed", show_progress, split=dense.split)[0])
        else:
            p = self.embed_pass(
                texts, instruction, output=output, task=multivector.task_of(prompt_name), instructions=instructions
            )
            out = self.run_passes([p], "embed", show_progress)[0]
        return quantize_output(out, precision)

    @gated_call
    def embed_chunks(
        self,
        docs: list[str],
        chunk_tokens: int = 128,
        *,
        late: bool = True,
        overlap: int | None = None,
        instruction=_UNSET,
        show_progress: bool | None = None,
    ):
        """Late chunking: ``(embeddings (M, dim) float32, chunks)``, ``chunks`` a DataFrame with ``doc, chunk,
        char_start, char_end, n_tokens, text``, one row per chunk of ``chunk_tokens`` tokens of each document.

        ``late=True``: each chunk's vector is the model's pooling over that chunk's token span, taken from ONE
        forward over the whole document, so every chunk sees its document (then the head: matryoshka, normalize).
        Documents past ``max_length`` run as macro-windows overlapping by ``overlap`` tokens (default
        ``chunk_tokens``); each chunk is pooled from the window that holds it with the most context on its narrower
        side. ``late=False`` embeds each chunk's text on its own (the baseline). Empty documents have no chunks (no
        documents: a ``(0, dim)`` matrix and an empty table). The chunks' character spans tile each document
        (``lab.engine.windows.chunk_spans``). See ``lab.engine.windows``."""
        return windows.embed_chunks(
            self,
            check_texts(docs, "docs"),
            chunk_tokens,
            late=late,
            overlap=overlap,
            instruction=self._instruction(instruction),
            show_progress=show_progress,
        )

    @gated_call
    def encode(
        self,
        sentences=None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value=st_compat.MODEL_DEFAULT,
        precision: str = "float32",
        convert_to_numpy: bool | None = None,
        convert_to_tensor: bool = False,
        device=None,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        pool=None,
        chunk_size: int | None = None,
        **kwargs,
    ):
        """``SentenceTransformer.encode``: same arguments, same results (a single string gives one 1-D vector;
        ``convert_to_numpy=None``: numpy). On a ColBERT folder, ``MultiVectorEncoder.encode`` (with its ``task``):
        a list of per-token tensors. ``inputs=`` (sentence-transformers >= 5's name) is accepted for ``sentences``.
        See ``lab.engine.st_encode``."""
        args = {k: v for k, v in locals().items() if k not in ("self", "kwargs")}
        return st_compat.encode(self, kwargs=kwargs, **args)

    @gated_call
    def encode_query(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` with the model's ``query`` prompt (unless another is given, or the ``instruction`` knob is set:
        then the knob), as sentence-transformers (``lab.engine.st_encode``)."""
        name = st_compat.query_prompt_name(self, prompt, prompt_name)
        return self.encode(sentences, prompt_name=name, prompt=prompt, **st_compat.task_kw(self.spec, "query", kwargs))

    @gated_call
    def encode_document(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` with the model's ``document`` / ``passage`` / ``corpus`` prompt (the first it has, unless
        another is given), as sentence-transformers; the ``instruction`` knob is the query side's and does not apply
        (``lab.engine.st_encode``)."""
        name = st_compat.document_prompt_name(self.spec.prompts, prompt, prompt_name)
        return self.encode(
            sentences, prompt_name=name, prompt=prompt, **st_compat.task_kw(self.spec, "document", kwargs)
        )

    # ------------------------------------------------------------------------------------------- the pipeline
    @gated_call
    def run_passes(self, passes: list[Pass], desc: str, show_progress: bool | None = None, *, split: int = 0) -> list:
        """Run ``passes`` in one call: each pass's outputs in its input order (``desc``: the progress bar's label;
        ``split``: the inputs cut into windows, for ``stats.split``). ``stats`` are published only when every pass
        finished (a failed or interrupted call leaves the engine, its stats included, as it was)."""
        results, self.stats = build.run_passes(
            self, passes, desc, show_progress, split=split, warned=self._warned_lengths
        )
        return results

    # ------------------------------------------------------------------------------------------------ studies
    def as_mteb_model(self, **kwargs):
        """This engine as an mteb 2.x encoder (or cross-encoder) model; knob values name the variant.
        Keyword arguments go to ``lab.eval.mteb_adapter.as_mteb_model`` (instructions, name, revision, ...)."""
        from lab.eval.mteb_adapter import as_mteb_model

        return as_mteb_model(self, **kwargs)

    def panel(self):
        """An ipywidgets panel over ``configure``: knobs, sentences, Run -> similarity heatmap and stats."""
        from lab.eval.panel import build_panel

        return build_panel(self)

    # --------------------------------------------------------------------- score / rerank (lab.engine.rerank)
    @property
    def score_mode(self) -> str:
        """How ``score`` / ``rerank`` score by default: ``cross-encoder``, ``llm`` or ``bi-encoder``."""
        return rerank.default_mode(self)

    @gated_call
    def score(
        self,
        pairs,
        *,
        mode: str | None = None,
        activation: str | None = "default",
        instruction=_UNSET,
        prompt=None,
        similarity: str = "cosine",
        show_progress: bool | None = None,
    ) -> np.ndarray:
        """Scores of ``(query, document)`` pairs, in input order: ``(N,)`` float32, ``(N, num_labels)`` for a
        multi-label cross-encoder. ``mode``: ``cross-encoder`` | ``llm`` | ``bi-encoder`` (default
        ``score_mode``) | ``late-interaction`` (ColBERT MaxSim) | ``sparse`` (lexical weights) | ``m3`` (bge-m3's
        weighted dense + sparse + ColBERT); ``activation``: ``default`` (CrossEncoder.predict's; P(yes); raw
        similarity), ``None`` (raw), ``sigmoid``, ``softmax``, ``tanh``; ``prompt``: a
        ``lab.engine.rerank.YesNoPrompt`` for ``llm``; ``similarity``: ``cosine`` or ``dot`` for ``bi-encoder``. See
        ``lab.engine.rerank``."""
        job = rerank.score_job(
            self,
            pairs,
            mode=mode,
            activation=activation,
            instruction=self._instruction(instruction),
            prompt=prompt,
            similarity=similarity,
        )
        return job.combine(self.run_passes(job.passes, "score", show_progress, split=job.split))

    @gated_call
    def rerank(self, query: str, documents: list[str], *, top_k: int | None = None, **score_kwargs):
        """``documents`` sorted best first for ``query``: a pandas DataFrame with ``rank``, ``index`` (into
        ``documents``), ``score``, ``document``; ``top_k`` keeps the best k. ``score_kwargs`` as in ``score``."""
        return rerank.rerank(self, query, documents, top_k=top_k, **score_kwargs)

    def similarity(self, a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """Cosine similarity matrix ``(n, m)`` between two sets of embeddings ``(n, dim)`` and ``(m, dim)``
        (``b=None``: ``a`` with itself; ``lab.outputs.scoring.cosine_matrix``)."""
        return cosine_matrix(a, b)


Engine.__init__.__signature__ = knob_signature(Engine.__init__, after="model")  # every knob, for help and IDEs
if Engine.__doc__:  # the knobs' help from their one table (lab.engine.knob_registry.KNOBS); absent under python -OO
    Engine.__doc__ = f"{Engine.__doc__.rstrip()}\n\n    Knobs:\n{knob_docs()}\n"
