"""mteb 2.x adapter: an Engine seen through mteb's encoder (or cross-encoder) protocol.

``as_mteb_model(engine)`` returns an object ``mteb.evaluate(model, tasks)`` accepts. ``encode`` drains mteb's
DataLoader and hands every text to one ``engine.embed`` call, so the engine's own scheduler does the batching
(mteb's ``batch_size`` is ignored). Query / document prompts become the engine's ``instruction`` (attended, not
pooled), chosen like sentence-transformers chooses prompts. The model meta names the model and carries the
result-changing knob values as mteb ``experiment_kwargs``, so mteb's ResultCache stores each variant apart:
``results/<model>/<revision>/experiments/<pooling_mean__bidirectional_True...>/<Task>.json``.
``resolve_tasks`` turns task names into mteb task objects (the checkout's local copies first; ``lab.eval.sweeps`` and
``lab.eval.retrieval`` both use it).

    >>> model = as_mteb_model(engine, instructions={"query": "Represent this query for retrieval"})
    >>> mteb.evaluate(model, evals.tasks.get_tasks(["STSBenchmark"]), cache=mteb.ResultCache("evals/results/cache"))
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Knobs that change speed or memory but not the numbers: kept out of the experiment name.
SCHEDULING_KNOBS = frozenset({"max_batch_tokens", "max_num_seqs", "prefix_cache", "device", "show_progress",
                              "cpu_workers"})


def as_mteb_model(
    engine,
    *,
    instructions: Mapping[str, str] | None = None,
    use_task_instructions: bool = False,
    name: str | None = None,
    revision: str | None = None,
) -> EngineEncoder | EngineCrossEncoder:
    """Wrap ``engine`` for ``mteb.evaluate``.

    Args:
        instructions: prompts keyed like sentence-transformers' ``prompts`` / mteb's ``model_prompts``:
            ``"{task name}-{query|document}"``, ``"{task name}"``, ``"{task type}-{query|document}"``,
            ``"{task type}"`` or ``"query"`` / ``"document"``, most specific first. Default: the model's own
            sentence-transformers prompts (``config_sentence_transformers.json``), if any.
        use_task_instructions: when no key matches, fall back to the task's own instruction (mteb's
            ``TaskMetadata.prompt``), for queries and symmetric tasks only, the way instruction-tuned
            embedders are evaluated.
        name / revision: override the model name and revision recorded in results.
    """
    cls = EngineCrossEncoder if getattr(engine, "is_cross_encoder", False) else EngineEncoder
    return cls(
        engine,
        instructions=instructions,
        use_task_instructions=use_task_instructions,
        name=name,
        revision=revision,
    )


class _EngineModel:
    def __init__(self, engine, *, instructions, use_task_instructions, name, revision) -> None:
        self.engine = engine
        self.model_path = Path(engine.model_path) if getattr(engine, "model_path", None) else None
        st_config = _read_json(self.model_path / "config_sentence_transformers.json") if self.model_path else {}
        if instructions is None:
            instructions = st_config.get("prompts") or {}
        self.instructions = {k: v for k, v in dict(instructions).items() if v}
        self.use_task_instructions = use_task_instructions
        self.similarity_fn_name = "dot" if st_config.get("similarity_fn_name") == "dot" else "cosine"
        self._name = name
        self._revision = revision

    # ---- metadata -------------------------------------------------------------------------------------------
    @property
    def mteb_model_meta(self):
        """Rebuilt on each access from the engine's current knobs (``mteb.evaluate`` reads it once per call)."""
        from mteb.models.model_meta import ModelMeta

        return ModelMeta(
            loader=None,
            name=self._name or model_name(self.engine),
            revision=self._revision or model_revision(self.engine),
            release_date=None,
            languages=None,
            n_parameters=getattr(self.engine, "n_parameters", None),
            memory_usage_mb=None,
            max_tokens=result_knobs(self.engine).get("max_length"),
            embed_dim=getattr(self.engine, "embedding_dim", None),
            license=None,
            open_weights=True,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch"],
            similarity_fn_name=self.similarity_fn_name,
            use_instructions=bool(self.instructions) or self.use_task_instructions,
            training_datasets=None,
            modalities=["text"],
            model_type=["cross-encoder"] if self.engine_is_cross_encoder else ["dense"],
            experiment_kwargs=self.experiment_kwargs() or None,
        )

    @property
    def engine_is_cross_encoder(self) -> bool:
        return bool(getattr(self.engine, "is_cross_encoder", False))

    def experiment_kwargs(self) -> dict[str, Any]:
        """The knob values that can change scores, as mteb names experiments (plus our prompts, if any)."""
        kwargs = result_knobs(self.engine)
        if self.instructions:
            kwargs["prompts"] = dict(sorted(self.instructions.items()))
        if self.use_task_instructions:
            kwargs["task_instructions"] = True
        return kwargs

    # ---- prompts --------------------------------------------------------------------------------------------
    def instruction_for(self, task_metadata, prompt_type) -> str | None:
        """sentence-transformers' order: ``{task}-{kind}``, ``{task}``, ``{type}-{kind}``, ``{type}``, ``{kind}``;
        then, with ``use_task_instructions``, the task's own prompt (not for documents). ``None``: no prompt."""
        kind = getattr(prompt_type, "value", prompt_type)
        keys = []
        for scope in (task_metadata.name, task_metadata.type):
            if kind:
                keys.append(f"{scope}-{kind}")
            keys.append(scope)
        if kind:
            keys.append(kind)
        for key in keys:
            if key in self.instructions:
                return self.instructions[key]
        if self.use_task_instructions and kind != "document":
            prompt = task_metadata.prompt
            if isinstance(prompt, dict):
                prompt = prompt.get(kind or "query")
            return prompt or None
        return None


class EngineEncoder(_EngineModel):
    """mteb ``EncoderProtocol`` over an embedding Engine."""

    def encode(
        self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs
    ) -> np.ndarray:
        texts = drain_texts(inputs)
        instruction = self.instruction_for(task_metadata, prompt_type)
        if not texts:
            return np.zeros((0, getattr(self.engine, "embedding_dim", 0) or 0), dtype=np.float32)
        call = {"show_progress": kwargs.get("show_progress_bar")}
        if instruction is not None:  # otherwise the engine's own ``instruction`` knob applies
            call["instruction"] = instruction
        return np.asarray(self.engine.embed(texts, **call), dtype=np.float32)

    def similarity(self, embeddings1, embeddings2):
        from mteb.similarity_functions import cos_sim, dot_score

        return (dot_score if self.similarity_fn_name == "dot" else cos_sim)(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        from mteb.similarity_functions import pairwise_cos_sim, pairwise_dot_score

        fn = pairwise_dot_score if self.similarity_fn_name == "dot" else pairwise_cos_sim
        return fn(embeddings1, embeddings2)


class EngineCrossEncoder(_EngineModel):
    """mteb ``CrossEncoderProtocol`` over a cross-encoder Engine: one ``engine.score`` call over all pairs."""

    def predict(self, inputs1, inputs2, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs):
        first, second = drain_texts(inputs1), drain_texts(inputs2)
        if len(first) != len(second):
            raise ValueError(f"predict got {len(first)} first inputs but {len(second)} second inputs")
        if not first:
            return np.zeros(0, dtype=np.float32)
        return np.asarray(self.engine.score(list(zip(first, second))), dtype=np.float32).reshape(-1)


def drain_texts(loader) -> list[str]:
    """All texts of an mteb DataLoader (batches are dicts with a ``text`` list), in order."""
    texts: list[str] = []
    for batch in loader:
        if "text" not in batch:
            raise TypeError(f"only text inputs are supported; got a batch with keys {sorted(batch)}")
        texts.extend(batch["text"])
    return texts


def result_knobs(engine) -> dict[str, Any]:
    """Knobs that can change scores, as they actually run: the engine's knobs minus scheduling ones, with
    ``None`` (model default) and ``auto`` replaced by ``engine.resolved`` values where the engine reports them
    (``bidirectional`` from ``resolved["causal"]``; ``layer`` as resolved, a positive index, left out at the last
    layer; ``adapters`` as ``engine.adapter_ids``, name plus a hash of each adapter's config and weights, left out
    when empty); what stays ``None`` is left out."""
    knobs = dict(engine.knobs)
    resolved = getattr(engine, "resolved", None)
    resolved = dict(resolved) if isinstance(resolved, Mapping) else {}
    if "causal" in resolved and "bidirectional" in knobs:
        resolved.setdefault("bidirectional", not resolved["causal"])
    for key, value in knobs.items():
        if (value is None or value == "auto") and resolved.get(key) is not None:
            knobs[key] = resolved[key]
    if resolved.get("layer") is not None:  # -1, None and the last layer's number: one variant, one folder, named
        last = getattr(engine, "num_layers", None)  # as before the knob existed
        knobs["layer"] = None if resolved["layer"] == last else resolved["layer"]
    if knobs.get("adapters"):  # each adapter as name-<content hash>: same-named folders are cached apart
        knobs["adapters"] = list(getattr(engine, "adapter_ids", None) or knobs["adapters"])
    else:
        knobs.pop("adapters", None)  # no adapters: the base model's experiment name, as before the knob existed
    if knobs.get("instruction_pooling") == "exact":  # the rule before the knob existed: named as before
        knobs.pop("instruction_pooling")
    return {k: v for k, v in sorted(knobs.items()) if k not in SCHEDULING_KNOBS and v is not None}


def model_name(engine) -> str:
    """mteb wants ``org/name``; a bare local name becomes ``local/<name>``."""
    name = str(getattr(engine, "model_name", None) or Path(engine.model_path).name)
    name = re.sub(r"[^\w./-]+", "_", name).strip("/")
    return name if "/" in name else f"local/{name}"


def model_revision(engine) -> str:
    """A Hugging Face snapshot hash when the path has one, else ``local-`` + a short hash of config.json and
    samples of the weight files (fine-tunes of one base share name, config and sizes, not weights)."""
    rev = getattr(engine, "revision", None)
    if isinstance(rev, str) and rev:
        return rev
    path = Path(engine.model_path)
    if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name):
        return path.name
    h = hashlib.sha256()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.suffix in {".safetensors", ".bin", ".gguf", ".pt"}:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:  # three 64 KiB samples: start, middle, end
                for offset in (0, size // 2, max(size - 65536, 0)):
                    fh.seek(offset)
                    h.update(fh.read(65536))
    return "local-" + h.hexdigest()[:12]


def _read_json(path: Path) -> dict:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def resolve_tasks(tasks) -> list:
    """Task names or mteb task objects -> task objects. Names go through ``evals.tasks.get_tasks`` (local data)
    when it can be imported, else ``mteb.get_tasks``."""
    if isinstance(tasks, str) or not isinstance(tasks, Iterable):
        tasks = [tasks]
    tasks = list(tasks)
    names = [t for t in tasks if isinstance(t, str)]
    if names:
        get_tasks = _local_get_tasks()
        if get_tasks is None:
            import mteb

            def get_tasks(ns):
                found = {t.metadata.name: t for t in mteb.get_tasks(tasks=ns)}
                return [found[n] for n in ns]

        by_name = dict(zip(names, get_tasks(names)))
        tasks = [by_name[t] if isinstance(t, str) else t for t in tasks]
    return tasks


def _local_get_tasks():
    """``evals.tasks.get_tasks`` from the repository next to ``lab/``; ``None`` when lab is installed alone."""
    from lab._repo import import_evals

    tasks = import_evals("tasks")
    return None if tasks is None else tasks.get_tasks
