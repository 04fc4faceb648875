"""``Engine``: load a model once, flip knobs live, embed / score / rerank with packed, prefill-only batches.

Every call runs one pipeline (``Engine.run_passes``), data flowing one way: ``Pass`` (texts, how to tokenize them, a
pooler) -> ``InputProcessor`` (tokenize, instruction, truncation records; the next wave tokenized while this one
runs) -> ``Executor`` (packed path or KV path, CPU workers on both; ``lab.engine.executor``) -> ``Pooler`` (method x
head: ``lab.outputs.pooling``, ``lab.outputs.heads``) -> ``OutputBuffer`` (input order), all inside one ``Call`` (one
``Stats``, timer, progress bar, truncation warning; ``lab.engine.call``). ``embed`` is one pass; ``score`` builds its
passes in ``lab.engine.rerank``, ``encode`` in ``lab.engine.st_encode``, both on the engine's public
seam: ``embed_pass`` (the pass ``embed`` runs, with another pooling or head if asked) and ``run_passes`` (passes run as
one call).

    >>> eng = Engine("sentence-transformers/all-MiniLM-L6-v2")   # a hub id, or a local folder
    >>> E = eng.embed(["A man plays a guitar.", "Someone plays guitar."])    # (2, 384) float32
    >>> eng.configure(pooling="cls", normalize=False)       # live, no weight reload
    >>> eng.stats                                           # sequences, tokens, batches, padded_tokens, ...
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import asdict, fields

import numpy as np
import torch

from lab.adapt.adapters import LoraAdapter, merged_weights, read_adapter, split_adapter_model
from lab.engine import framing, llm2vec, rerank, resolve, windows
from lab.engine import st_encode as st_compat
from lab.engine.call import Call, ExecSettings, OutputBuffer, Pass, Stats
from lab.engine.executor import Executor
from lab.engine.gate import Gate
from lab.engine.inputs import InputProcessor, Request, check_inputs, check_texts
from lab.engine.knobs import Knobs, ModelLimits, Resolved, check_for_model, knobs_doc, resolve_device, resolve_dtype
from lab.engine.scheduler import WAVE_SIZE, prefetch_waves
from lab.models import hub, model_class
from lab.models.folder import load_tokenizer, read_folder, read_state_dict
from lab.models.hf_fallback import HFFallbackModel
from lab.models.spec import ModelSpec
from lab.ops.attention import resolve_backend
from lab.ops.probes import check_forced
from lab.outputs import kinds as outputs
from lab.outputs import multivector
from lab.outputs.heads import EmbeddingHead, Pooler, TokensHead
from lab.outputs.kinds import output_pooler
from lab.outputs.pooling import pooling_method
from lab.outputs.quantize import check_precision, quantize_output
from lab.runtime import allocator
from lab.runtime.compiled import check_compile
from lab.runtime.runner import Runner

__all__ = ["Engine", "Stats"]

_UNSET = object()


def _call(method):
    """A public call: enters the engine's gate as a call (``lab.engine.gate``: one at a time, never while a
    ``configure`` runs), after repairing an interrupted ``configure`` alone."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._dirty:
            with self._gate.change():
                self._repair()
        with self._gate.call():
            return method(self, *args, **kwargs)

    return call


def _change(method):
    """A change of the engine (``configure``): enters the gate alone, once the other threads' calls finished."""

    @functools.wraps(method)
    def change(self, *args, **kwargs):
        with self._gate.change():
            return method(self, *args, **kwargs)

    return change


class Engine:
    """A prefill-only engine over one model folder. Every knob but ``model`` and ``device`` is live.

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
            folder or an adapter folder sets knob defaults (``model_defaults``).
        tune_allocator: on a CPU device, apply ``lab.runtime.allocator``'s glibc malloc settings to the whole
            process: large freed activations stay in the heap, so packed steps stop page-faulting on fresh memory,
            but the process keeps its peak heap until it exits and the settings cannot be undone. ``None`` (the
            default): ``LAB_MALLOC_TUNING=1`` turns it on, ``0`` or unset leaves glibc's defaults. Fixed at load, not
            a knob; ``resolved["malloc_tuning"]`` says whether the settings are in effect in this process.
        cpu_paths: CPU fast-path choices forced for this engine alone, name -> choice (e.g. ``{"f32_gemm":
            "onednn"}``; ``lab.ops.probes.CANDIDATES`` lists them); the others are probed on this machine. Fixed
            for the engine's life.
        compile: the packed forward through ``torch.compile`` (``lab.runtime.compiled``): ``True`` for every step
            it takes, ``False`` never, ``None`` (the default) where a call's eager time would pay the compile back
            and the compiled forward measured faster on this machine (``lab.runtime.planner.forward_choice``; the
            choice is ``cpu_paths["forward"]``). Fixed for the engine's life.

    Every other argument is a knob (``lab.engine.knobs.KNOB_DOCS``, listed below and in the README's knob table).

    Call kinds are built on two public methods (the seam ``lab.engine.rerank`` and ``lab.engine.st_encode`` use):
    ``embed_pass`` builds a ``Pass`` of texts as ``embed`` tokenizes and pools them, and ``run_passes`` runs passes
    as one call (one ``Stats``, published when every pass finished) and returns their outputs in input order.
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
        revision: str | None = None,
        bidirectional: bool | None = None,
        chunked_prefill: int | None = None,
        instruction: str | None = None,
        include_instruction: bool | None = None,
        instruction_pooling: str | None = None,
        template: str | None = None,
        append_eos: bool | None = None,
        prefix_cache: bool = True,
        attention_backend: str = "auto",
        cpu_workers: int | None = None,
        adapters: list[str] | tuple[str, ...] = (),
        layer: int | None = None,
        long_inputs: str = "truncate",
        doc_max_length: int | None = None,
        cpu_paths: dict[str, str] | None = None,
        tune_allocator: bool | None = None,
        compile: bool | None = None,
    ):
        tune = allocator.malloc_tuning_requested(tune_allocator)  # a bad LAB_MALLOC_TUNING fails before anything loads
        args = locals()  # every knob is a keyword argument of the same name (a KeyError here says which is not)
        knobs = {f.name: args[f.name] for f in fields(Knobs)}
        self._knobs = Knobs().replace(**knobs)
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a local model folder or a hub id ('org/name'), got {type(model).__name__}")
        self._source = hub.resolve(model, self._knobs.revision)  # a hub id: its snapshot folder, fetched if need be
        self._by_id = not os.path.exists(os.path.expanduser(os.fspath(model)))  # named by hub id, not by path
        self._adapter_folders: dict[str, str] = {}  # adapter name as given (a path or a hub id) -> its folder
        self._folder = str(self._source.folder)  # as given: llm2vec's base argument (lab.engine.llm2vec)
        model, adapters = split_adapter_model(self._folder, self._knobs.adapters)  # an adapter-only folder: its base
        self._auto = adapters[: len(adapters) - len(self._knobs.adapters)]  # the adapters that came with the folder
        self._knobs = self._knobs.replace(adapters=adapters)
        self.model_path = str(model)
        self.spec: ModelSpec = read_folder(model)
        self.device = resolve_device(self._knobs.device)
        forced = check_forced(cpu_paths)  # before anything loads: a bad name or choice changes nothing
        check_compile(compile, forced)
        if tune and self.device.type == "cpu":
            allocator.tune_cpu_allocator()
        self.tokenizer = load_tokenizer(self.spec)
        dtype = resolve_dtype(self._knobs.dtype, self.device)
        self.model = self._build_model(dtype, forced)
        self.runner = Runner(self.model, device=self.device, dtype=dtype, cpu_paths=forced, compile=compile)
        self.executor = Executor(self.runner)
        self._gate = Gate()  # one call at a time, configure between calls (lab.engine.gate)
        self._warned_lengths: set[int] = set()  # max_length values whose truncation this engine has warned about
        self._dirty = False  # a configure was interrupted while swapping weights (``_repair``)
        self._adapters: list[LoraAdapter] = []  # merged into the live weights, in order
        self._layouts: dict[tuple, llm2vec.Layout] = {}  # adapter list -> llm2vec's reading of the folders
        if self._knobs.adapters:
            self._adapters, merged = self._merge_adapters(self._knobs.adapters)
            self.runner.weights.set_merged(merged)
        self._check_for_model(self._knobs)
        self.stats = Stats()
        self._backend = resolve_backend(self._knobs.attention_backend, self.device)
        self.runner.plan_cpu_paths(self._workers)
        resolve.notice_llm2vec(self.model_name, self.llm2vec, self.resolved)

    # ----------------------------------------------------------------------------------------------- loading
    def _build_model(self, dtype: torch.dtype, forced: dict[str, str]):
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
        if self.device.type == "cpu":  # weight layouts, fixed at load (a later dtype change keeps them)
            model.choose_layouts(dtype, forced)
        model.load_hf_state_dict(read_state_dict(self.spec))
        return model

    # ------------------------------------------------------------------------------------------------- knobs
    @property
    def knobs(self) -> dict:
        """Current knob values as set (``None`` = the model's default; see ``resolved`` for what runs)."""
        return asdict(self._knobs)

    @property
    def resolved(self) -> Resolved:
        """The knob values that actually run, with model defaults filled in (a read-only mapping), and where each
        value the model decides came from (``resolved.sources``: ``"user"``, ``"llm2vec_config.json in <folder>"``,
        ``"llm2vec default"``, ``"sentence-transformers Pooling"``, ``"sentence-transformers config"``, ``"model
        default"``); ``malloc_tuning``: whether ``lab.runtime.allocator``'s process-wide settings are in effect
        (``tune_allocator``)."""
        k = self._knobs
        return Resolved({
            "pooling": self.pooling, "normalize": self.normalize, "truncate_dim": k.truncate_dim,
            "max_length": self.max_length, "causal": self.causal,
            "dtype": str(self.runner.dtype).removeprefix("torch."), "device": str(self.device),
            "attention_backend": self._backend, "chunked_prefill": k.chunked_prefill,
            "instruction": self._instruction(),
            "include_instruction": self.include_instruction, "append_eos": self.append_eos,
            "instruction_pooling": self.instruction_pooling, "template": k.template,
            "cpu_workers": self._workers, "layer": self.layer, "long_inputs": k.long_inputs,
            "adapters": self.adapter_names, "cpu_paths": self.cpu_paths, "malloc_tuning": allocator.in_effect(),
            "doc_max_length": self.doc_max_length,
        }, resolve.sources(k, self._defaults(k)))

    @property
    def _workers(self) -> int:
        """The CPU workers a packed step is shared among under the knobs in force (``Runner.cpu_workers``)."""
        return self.runner.cpu_workers(self._knobs.cpu_workers, self._backend)

    @property
    def cpu_paths(self) -> dict[str, str]:
        """The CPU fast paths in force, decided by short probes on this machine (``lab.ops.probes``): name ->
        choice, e.g. ``{"rope_layout": "pairs", "bf16_gemm": "native"}``; ``{}`` off the CPU.
        They belong to this engine: ``Engine(..., cpu_paths={"f32_gemm": "onednn"})`` forces choices for it alone
        (``lab.ops.probes.CANDIDATES`` lists the names and choices), ``LAB_CPU_<NAME>`` for every engine made while
        it is set; ``runner.decisions`` says how each was made and ``lab.ops.probes.decisions()`` has the timings.
        ``forward`` (``eager`` / ``compiled``, the ``compile`` argument) appears once a call has decided it."""
        return {**self.model.layout, **{d.name: d.choice for d in self.runner.decisions}}

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters merged into the weights, in order (folder names; see ``adapter_ids``)."""
        return [a.name for a in self._adapters]

    @property
    def adapter_ids(self) -> list[str]:
        """``name-<content hash>`` of each merged adapter: two folders with one name (or one folder retrained)
        differ. MTEB results are cached apart by these."""
        return [a.id for a in self._adapters]

    def _adapter_folder(self, name: str) -> str:
        """The folder of an adapter named by path or hub id (``org/name[@revision]``, fetched into the Hugging Face
        cache when need be; ``lab.models.hub``), resolved once per engine."""
        if name not in self._adapter_folders:
            self._adapter_folders[name] = str(hub.resolve(name, what="adapter").folder)
        return self._adapter_folders[name]

    def _merge_adapters(self, paths: tuple[str, ...]):
        """Read and check ``paths`` and merge them over the base weights: ``(adapters, {parameter: float32})``.
        Changes nothing: the caller swaps the result in (``Runner.set_merged``)."""
        if paths and not self.model.packed:
            raise ValueError(
                f"adapters need a packed model, but {self.spec.architecture or 'this architecture'} runs through the "
                "transformers fallback (no packed implementation here). Merge the adapter with peft "
                "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(out)) and load that "
                "folder"
            )
        adapters = [read_adapter(self._adapter_folder(p)) for p in paths]
        return adapters, merged_weights(self.model, self.runner.weights.base, adapters)

    @_change
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
            self.runner.weights.set_merged(merged)
            self._adapters = adapters
        self.runner.weights.set_dtype(dtype)
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
        self.runner.weights.set_merged(merged)
        self._adapters = adapters
        self.runner.weights.set_dtype(resolve_dtype(k.dtype, self.device), force=True)  # every weight from its source
        self.runner.plan_cpu_paths(self._workers)
        self._dirty = False

    def validate(self, **knobs) -> Knobs:
        """Check a knob change without applying it (``configure`` runs the same checks first): the new knob values,
        or ``ValueError``/``TypeError`` naming the knob, the value and the valid range. Sweeps call it on every
        variant before running any (``lab.evaluate``)."""
        if "device" in knobs and knobs["device"] != self._knobs.device:
            raise ValueError("device cannot change live (it moves every weight); create a new Engine instead")
        if "revision" in knobs and knobs["revision"] != self._knobs.revision:
            raise ValueError("revision cannot change live (it is another snapshot of the weights); create a new "
                             f"Engine instead: Engine({self.model_name!r}, revision={knobs['revision']!r})")
        new = self._knobs.replace(**knobs)
        self._check_for_model(new)
        resolve_backend(new.attention_backend, self.device)
        resolve_dtype(new.dtype, self.device)
        return new

    def _check_for_model(self, k: Knobs) -> None:
        """The knob values that depend on this model (sizes, layers, attention), checked by ``lab.engine.knobs``."""
        check_for_model(k, ModelLimits(
            hidden=self.model.hidden_size, is_decoder=bool(self.model.is_decoder), num_layers=self.model.num_layers,
            positions=self.model.max_positions or self.spec.config.get("max_position_embeddings"),
            specials=len(self.tokenizer("", add_special_tokens=True)["input_ids"]), causal=self._causal_for(k)))

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
        return (not k.bidirectional) if k.bidirectional is not None else self._defaults(k)["causal"][0]

    @property
    def is_decoder(self) -> bool:
        return bool(self.model.is_decoder)

    @property
    def is_cross_encoder(self) -> bool:
        return self.model.classifier is not None

    @property
    def causal(self) -> bool:
        return self._causal_for(self._knobs)

    def _layout(self, adapters: tuple[str, ...]) -> llm2vec.Layout:
        """llm2vec's reading of the model folder with ``adapters`` (``lab.engine.llm2vec``), once per adapter list."""
        if adapters not in self._layouts:
            auto = len(self._auto) if adapters[: len(self._auto)] == self._auto else 0
            self._layouts[adapters] = llm2vec.layout(
                self._folder, [self._adapter_folder(a) for a in adapters], auto=auto, base=self.model_path,
                repo_id=self._source.repo_id if self._by_id else None, decoder=bool(self.model.is_decoder))
        return self._layouts[adapters]

    @property
    def llm2vec(self) -> llm2vec.Layout:
        """llm2vec's reading of the model folder and the adapters in force (``lab.engine.llm2vec.Layout``): whether
        they are an LLM2Vec layout and by what, the folder its settings come from, the name its chat template is
        chosen by."""
        return self._layout(self._knobs.adapters)

    def _defaults(self, k: Knobs) -> dict[str, tuple]:
        """What a knob left at ``None`` resolves to under the adapters of ``k``, with where that value comes from:
        knob -> (value, source) (``lab.engine.resolve.defaults``)."""
        return resolve.defaults(k, self._layout(k.adapters), self.spec, decoder=bool(self.model.is_decoder),
                                default_causal=bool(self.model.default_causal))

    def _value(self, name: str, k: Knobs | None = None):
        """A knob's value as it runs: the knob when set, else its default (``_defaults``)."""
        k = k or self._knobs
        set_to = getattr(k, name)
        return set_to if set_to is not None else self._defaults(k)[name][0]

    @property
    def model_defaults(self) -> dict:
        """What the model and its adapters set the knobs left at ``None`` to: knob -> value (``resolved.sources``
        says where each came from)."""
        return {name: value for name, (value, _) in self._defaults(self._knobs).items()}

    @property
    def pooling(self) -> str:
        return self._value("pooling")

    @property
    def normalize(self) -> bool:
        return self._value("normalize")

    @property
    def doc_max_length(self) -> int | None:
        """llm2vec's document cut in force (``lab.engine.llm2vec.cut_document``): the knob (``0`` = off), else the
        LLM2Vec layout's (``llm2vec_config.json`` or llm2vec's 400), else ``None`` (off)."""
        return self._value("doc_max_length") or None

    @property
    def append_eos(self) -> bool:
        """The knob, else on for decoders with ``lasttoken`` pooling under the ``exact`` rule (llm2vec appends no EOS
        token: under its rule ``eos_token`` pooling appends llm2vec's EOS text instead)."""
        if self._knobs.append_eos is not None:
            return self._knobs.append_eos
        return self.is_decoder and self.pooling == "lasttoken" and self.instruction_pooling == "exact"

    @property
    def instruction_pooling(self) -> str:
        """The pooling rule for inputs with instructions (``lab.engine.framing``): the knob, else ``llm2vec`` for an
        LLM2Vec layout (``lab.engine.llm2vec``), else ``exact``."""
        return self._value("instruction_pooling")

    def _framing(self) -> framing.Framing:
        """How this engine's inputs are framed under the knobs in force (rule, template, chat template, EOS text)."""
        rule = self.instruction_pooling
        name = self._layout(self._knobs.adapters).name
        names = [name] if name else []
        eos = framing.eos_text(names, self.spec.config.get("model_type")) if self.pooling == "eos_token" else ""
        return framing.Framing(rule=rule, template=self._knobs.template, eos=eos,
                               chat=framing.chat_template(names) if rule == "llm2vec" else None)

    @property
    def max_length(self) -> int:
        if self._knobs.max_length is not None:
            return self._knobs.max_length
        limits = [self._defaults(self._knobs)["max_length"][0]]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if tok_max and tok_max < 1_000_000:
            limits.append(tok_max)
        limits.append(self.model.max_positions or self.spec.config.get("max_position_embeddings"))
        return min(x for x in limits if x) if any(limits) else 512

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
        layer = "" if r["layer"] == self.model.num_layers else f"layer={r['layer']}, "
        adapters = f"adapters={r['adapters']}, " if r["adapters"] else ""
        return (
            f"Engine({self.model_name!r}, revision={self.revision[:12]!r}, {self.spec.architecture}, "
            f"pooling={r['pooling']}, "
            f"causal={r['causal']}, normalize={r['normalize']}, {layer}{adapters}dtype={r['dtype']}, "
            f"device={r['device']})"
        )

    # ------------------------------------------------------------------------------------------------- embed
    def _processor(self, max_length: int | None = None) -> InputProcessor:
        """The engine's input processor (``max_length``: a per-call cap instead of the engine's)."""
        return InputProcessor(self.tokenizer, max_length or self.max_length, append_eos=self.append_eos)

    def _instruction(self, instruction=_UNSET, prompt_name: str | None = None) -> str | None:
        """The call's instruction: ``prompt_name``'s prompt, else ``instruction``, else the knob, else the model's
        default prompt (``default_prompt_name``), as sentence-transformers resolves prompts."""
        if prompt_name is not None:
            if instruction is not _UNSET:
                raise ValueError("pass either instruction= (the text) or prompt_name= (a key of the model's "
                                 "prompts), not both")
            return st_compat.resolve_prompt(self.spec.prompts, None, None, prompt_name)
        instr = self._knobs.instruction if instruction is _UNSET else instruction
        if instr is not None and not isinstance(instr, str):
            raise TypeError(f"instruction must be a string or None, got {type(instr).__name__}")
        if instr is None and instruction is _UNSET:
            return st_compat.resolve_prompt(self.spec.prompts, self.spec.default_prompt_name, None, None)
        return instr

    @property
    def prompts(self) -> dict[str, str]:
        """The prompts ``prompt_name=`` names: sentence-transformers' empty ``query`` / ``document`` updated with
        the model folder's (``config_sentence_transformers.json``)."""
        return dict(self.spec.prompts)

    @property
    def include_instruction(self) -> bool:
        """Whether instruction tokens are pooled: the knob, else ``llm2vec_config.json``'s ``skip_instruction``
        negated (``model_defaults``), else the model's Pooling config (``include_prompt``, as
        ``SentenceTransformer.encode(prompt=...)`` pools them), else ``False`` (llm2vec's embed mask)."""
        return bool(self._value("include_instruction"))

    def cut_documents(self, texts: list[str]) -> list[str]:
        """``texts`` after llm2vec's document cut (the ``doc_max_length`` in force; ``lab.engine.llm2vec``), the same
        list when the cut is off. Every call kind's texts pass here before they are framed and tokenized."""
        limit = self.doc_max_length
        return llm2vec.cut_documents(self.tokenizer, texts, self.max_length, limit) if limit and texts else texts

    @_call
    def tokenize(self, texts: list[str], *, instruction=_UNSET, prompt_name: str | None = None) -> list[Request]:
        """The requests ``embed(texts, instruction=...)`` runs: token ids after truncation, ``pool_start`` (the
        instruction's tokens, attended to but not pooled) and whether each input was cut."""
        texts, instructions = check_inputs(texts)
        return self.embed_pass(texts, self._instruction(instruction, prompt_name),
                               instructions=instructions).tokenize(texts, 0)

    def _embedding_head(self) -> EmbeddingHead:
        """The engine's embedding head: matryoshka ``truncate_dim``, then normalize as the knobs say."""
        return EmbeddingHead(self.model.hidden_size, truncate_dim=self._knobs.truncate_dim, normalize=self.normalize)

    def embed_pass(self, texts: list[str], instruction: str | None, pooling: str | None = None, *,
                   head=None, include: bool | None = None, output="dense", task: str | None = None,
                   instructions: list[str] | None = None) -> Pass:
        """The pass ``embed`` runs over ``texts`` with ``instruction`` (a resolved instruction text or ``None``),
        for ``run_passes``. ``pooling``: a method name, default the engine's; ``head``: a
        ``lab.outputs.heads.Head``, default the engine's ``EmbeddingHead``; ``include``: pool the instruction,
        default ``include_instruction``; ``output``: as ``embed``'s, checked here; ``task``: a ColBERT folder's,
        ``lab.outputs.multivector``, which then sets the lengths, the query expansion and pools the prompt;
        ``instructions``: one per text (``[instruction, text]`` inputs), replacing ``instruction``."""
        mv = self.spec.multi_vector if "colbert" in outputs.parse_output(output)[0] else None
        proc = self._processor(None if mv is None else
                               multivector.max_length(mv, task, self.max_length, self._knobs.max_length))
        include = True if mv is not None else self.include_instruction if include is None else include
        method = pooling_method(framing.kernel_pooling(pooling or self.pooling))
        if self._knobs.template is not None and set(outputs.parse_output(output)[0]) - {"dense", "tokens"}:
            raise ValueError(f"the template knob applies to dense and token outputs, not output={output!r}; set "
                             "template=None for sparse / ColBERT outputs")
        proc.framing = self._framing()
        if head is None:
            head = self._embedding_head()
        pooler = output_pooler(output, Pooler(method, head), model=self.model, spec=self.spec,
                               tokenizer=self.tokenizer, task=task)
        expand = mv is not None and task == "query" and mv.query_expansion is not None
        if expand:
            fill = multivector.expansion_token_id(mv, self.tokenizer, causal=self.causal)

        def tokenize(chunk: list[str], first: int) -> list[Request]:
            per_item = None if instructions is None else instructions[first : first + len(chunk)]
            reqs = proc.process(self.cut_documents(chunk), first_index=first, instruction=instruction,
                                include_instruction=include, instructions=per_item)
            return multivector.expand(reqs, mv, fill) if expand else reqs

        prefixed = instruction or instructions is not None or self._knobs.template is not None
        return Pass(texts, tokenize, pooler, shared_prefix=bool(prefixed and not include))

    @_call
    def embed(self, texts: list[str], *, output="dense", instruction=_UNSET, prompt_name: str | None = None,
              precision: str = "float32", show_progress: bool | None = None):
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
        names = outputs.parse_output(output)[0]
        check_precision(precision, rows=len(texts) if names == ("dense",) else None)
        if precision != "float32" and "sparse" in names:
            raise ValueError("precision applies to dense, token and ColBERT vectors, not to sparse weights; ask for "
                             "output='sparse' separately with precision='float32'")
        if self._knobs.long_inputs == "chunk" and names != ("dense",):
            raise ValueError(f"long_inputs='chunk' averages one dense vector per window; output={output!r} needs "
                             "long_inputs='truncate' (or embed_chunks for vectors per span of a long document)")
        instruction = self._instruction(instruction, prompt_name)
        if instructions is not None and self._knobs.long_inputs == "chunk":
            raise ValueError("[instruction, text] inputs need long_inputs='truncate' (windows of a split input share "
                             "one instruction); pass instruction=... with plain texts instead")
        if self._knobs.long_inputs == "chunk":
            out = self._embed_split(texts, instruction, show_progress)
        else:
            p = self.embed_pass(texts, instruction, output=output, task=multivector.task_of(prompt_name),
                                instructions=instructions)
            out = self.run_passes([p], "embed", show_progress)[0]
        return quantize_output(out, precision)

    def _embed_split(self, texts: list[str], instruction: str | None, show_progress: bool | None) -> np.ndarray:
        """``embed`` under ``long_inputs="chunk"``: inputs past ``max_length`` become windows, pooled, averaged per
        input, then the embedding head (``lab.engine.windows.dense_pass``)."""
        dense = windows.dense_pass(self, texts, instruction)
        return dense.finish(self.run_passes([dense.run], "embed", show_progress, split=dense.split)[0])

    @_call
    def embed_chunks(self, docs: list[str], chunk_tokens: int = 128, *, late: bool = True, overlap: int | None = None,
                     instruction=_UNSET, show_progress: bool | None = None):
        """Late chunking: ``(embeddings (M, dim) float32, chunks)``, ``chunks`` a DataFrame with ``doc, chunk,
        char_start, char_end, n_tokens, text``, one row per chunk of ``chunk_tokens`` tokens of each document.

        ``late=True``: each chunk's vector is the model's pooling over that chunk's token span, taken from ONE
        forward over the whole document, so every chunk sees its document (then the head: matryoshka, normalize).
        Documents past ``max_length`` run as macro-windows overlapping by ``overlap`` tokens (default
        ``chunk_tokens``); each chunk is pooled from the window that holds it with the most context on its narrower
        side. ``late=False`` embeds each chunk's text on its own (the baseline). Empty documents have no chunks (no
        documents: a ``(0, dim)`` matrix and an empty table). The chunks' character spans tile each document
        (``lab.engine.windows.chunk_spans``). See ``lab.engine.windows``."""
        docs = check_texts(docs, "docs")
        if self._knobs.template is not None:
            raise ValueError("embed_chunks embeds spans of a document, which a template cannot frame; set "
                             "template=None for it")
        proc, instruction = self._processor(), self._instruction(instruction)
        plan = windows.plan_chunks(proc, docs, windows.frame(proc, instruction, True), chunk_tokens, overlap)
        table = plan.chunks[["doc", "chunk", "char_start", "char_end", "n_tokens", "text"]].copy()
        if table.empty:  # no documents, or only empty ones: no chunk to embed
            return np.zeros((0, self.embedding_dim), dtype=np.float32), table
        if not late:
            return self.embed(table["text"].tolist(), instruction=instruction, show_progress=show_progress), table
        p = Pass(plan.windows, lambda chunk, first: chunk, Pooler(pooling_method("tokens"), TokensHead()))
        rows = self.run_passes([p], "embed_chunks", show_progress)[0]
        return self._embedding_head()(windows.pool_chunks(plan, rows, framing.kernel_pooling(self.pooling)),
                                      None).numpy(), table

    @_call
    def encode(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, batch_size: int = 32,
               show_progress_bar: bool | None = None, output_value=st_compat.MODEL_DEFAULT,
               precision: str = "float32", convert_to_numpy: bool | None = None, convert_to_tensor: bool = False,
               device=None, normalize_embeddings: bool = False, truncate_dim: int | None = None, pool=None,
               chunk_size: int | None = None, **kwargs):
        """``SentenceTransformer.encode``: same arguments, same results (a single string gives one 1-D vector;
        ``convert_to_numpy=None``: numpy). On a ColBERT folder, ``MultiVectorEncoder.encode`` (with its ``task``):
        a list of per-token tensors. ``inputs=`` (sentence-transformers >= 5's name) is accepted for ``sentences``.
        See ``lab.engine.st_encode``."""
        args = {k: v for k, v in locals().items() if k not in ("self", "kwargs")}
        if "inputs" in kwargs:
            if sentences is not None:
                raise TypeError("encode() got both sentences and inputs; pass one")
            args["sentences"] = kwargs.pop("inputs")
        return st_compat.encode(self, kwargs=kwargs, **args)

    @_call
    def encode_query(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` with the model's ``query`` prompt (unless another is given, or the ``instruction`` knob is set:
        then the knob), as sentence-transformers (``lab.engine.st_encode``)."""
        name = st_compat.query_prompt_name(self, prompt, prompt_name)
        return self.encode(sentences, prompt_name=name, prompt=prompt, **st_compat.task_kw(self.spec, "query", kwargs))

    @_call
    def encode_document(self, sentences=None, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """``encode`` with the model's ``document`` / ``passage`` / ``corpus`` prompt (the first it has, unless
        another is given), as sentence-transformers; the ``instruction`` knob is the query side's and does not apply
        (``lab.engine.st_encode``)."""
        name = st_compat.document_prompt_name(self.spec.prompts, prompt, prompt_name)
        return self.encode(sentences, prompt_name=name, prompt=prompt,
                           **st_compat.task_kw(self.spec, "document", kwargs))

    # ------------------------------------------------------------------------------------------- the pipeline
    def _settings(self, items: int = 0) -> ExecSettings:
        k = self._knobs
        return ExecSettings(causal=self.causal, backend=self._backend, workers=self._workers, num_layers=self.layer,
                            max_batch_tokens=k.max_batch_tokens, max_num_seqs=k.max_num_seqs,
                            chunked_prefill=k.chunked_prefill, prefix_cache=k.prefix_cache, items=items)

    @_call
    def run_passes(self, passes: list[Pass], desc: str, show_progress: bool | None = None, *, split: int = 0) -> list:
        """Run ``passes`` in one call: each pass's outputs in its input order (``desc``: the progress bar's label;
        ``split``: the inputs cut into windows, for ``stats.split``). ``stats`` are published only when every pass
        finished (a failed or interrupted call leaves the engine, its stats included, as it was)."""
        settings = self._settings(sum(len(p.items) for p in passes))
        stats = Stats(path="packed" if self.model.packed else "transformers-fallback (padded)",
                      backend=self._backend, adapters=tuple(self.adapter_names), split=split, model=self.model_name,
                      revision=self.revision)
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

    @_call
    def score(self, pairs, *, mode: str | None = None, activation: str | None = "default", instruction=_UNSET,
              prompt=None, similarity: str = "cosine", show_progress: bool | None = None) -> np.ndarray:
        """Scores of ``(query, document)`` pairs, in input order: ``(N,)`` float32, ``(N, num_labels)`` for a
        multi-label cross-encoder. ``mode``: ``cross-encoder`` | ``llm`` | ``bi-encoder`` (default
        ``score_mode``) | ``late-interaction`` (ColBERT MaxSim) | ``sparse`` (lexical weights) | ``m3`` (bge-m3's
        weighted dense + sparse + ColBERT); ``activation``: ``default`` (CrossEncoder.predict's; P(yes); raw
        similarity), ``None`` (raw), ``sigmoid``, ``softmax``, ``tanh``; ``prompt``: a
        ``lab.engine.rerank.YesNoPrompt`` for ``llm``; ``similarity``: ``cosine`` or ``dot`` for ``bi-encoder``. See
        ``lab.engine.rerank``."""
        job = rerank.score_job(self, pairs, mode=mode, activation=activation, instruction=self._instruction(
            instruction), prompt=prompt, similarity=similarity)
        return job.combine(self.run_passes(job.passes, "score", show_progress, split=job.split))

    @_call
    def rerank(self, query: str, documents: list[str], *, top_k: int | None = None, **score_kwargs):
        """``documents`` sorted best first for ``query``: a pandas DataFrame with ``rank``, ``index`` (into
        ``documents``), ``score``, ``document``; ``top_k`` keeps the best k. ``score_kwargs`` as in ``score``."""
        return rerank.rerank(self, query, documents, top_k=top_k, **score_kwargs)

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


if Engine.__doc__:  # the knobs' help from their one table (lab.engine.knobs.KNOB_DOCS); absent under python -OO
    Engine.__doc__ = f"{Engine.__doc__.rstrip()}\n\n    Knobs:\n{knobs_doc()}\n"
