"""mteb 2.x adapter: an Engine seen through mteb's encoder (or cross-encoder) protocol.

``as_mteb_model(engine)`` returns an object ``mteb.evaluate(model, tasks)`` accepts. ``encode`` drains mteb's
DataLoader and hands every text to one ``engine.embed`` call, so the engine's own scheduler does the batching
(mteb's ``batch_size`` is ignored). Query / document prompts become the engine's ``instruction`` (attended, not
pooled), chosen like sentence-transformers chooses prompts.

The model meta (``model_meta.json`` in the results) is filled from the model: name (``org/name``; a local folder
``local/<name>``), revision, parameter count, fp32 memory, embedding size, token limit, similarity function, the Hub
page for a hub id, and license / languages / release date from the folder's model card (``lab.eval.model_card``).
Where it lands in mteb's ResultCache follows the knobs:

- every knob at its default (``lab.engine.knobs.Knobs()``; a ``layer`` naming the last layer and an empty
  ``adapters`` count as defaults), the model's own prompts: no ``experiment_kwargs``, so the results are the plain
  run in mteb's standard layout, ``results/<org__name>/<revision>/<Task>.json`` + ``model_meta.json``, the folder the
  leaderboard and ``ResultCache.load_results`` read;
- any result-changing knob set away from its default, prompts passed in, or task instructions: every
  result-changing knob as it runs (``result_knobs``; merged adapters as their ids), plus the prompts, as
  ``experiment_kwargs``, so the variant is filed apart and never overwrites the plain run:
  ``results/<org__name>/<revision>/experiments/<pooling_mean__bidirectional_True...>/<Task>.json``.

``resolve_tasks`` turns task names, benchmark names and mteb ``Benchmark`` objects into mteb task objects (task
names: the checkout's local copies first; ``lab.eval.sweeps`` and ``lab.eval.retrieval`` both use it). A cache
from ``lab.eval.sweeps.resolve_cache`` writes each result whole (mteb's own ``ResultCache`` rewrites a result file in
place, so a full disk or a killed run can leave it truncated) and computes a damaged one again.

    >>> model = as_mteb_model(engine, instructions={"query": "Represent this query for retrieval"})
    >>> mteb.evaluate(model, evals.tasks.get_tasks(["STSBenchmark"]), cache=resolve_cache("evals/results/cache"))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Knobs that change speed or memory but not the numbers: kept out of the experiment name.
SCHEDULING_KNOBS = frozenset(
    {"max_batch_tokens", "max_num_seqs", "prefix_cache", "device", "show_progress", "cpu_workers"}
)
# Knobs that say which model loaded (already in the results' path and model meta), not how it runs.
IDENTITY_KNOBS = frozenset({"revision"})


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
        own = {k: v for k, v in (st_config.get("prompts") or {}).items() if v}
        if instructions is None:
            instructions = own
        self.instructions = {k: v for k, v in dict(instructions).items() if v}
        self.prompts_given = self.instructions != own  # prompts other than the model's own: not the plain run
        self.use_task_instructions = use_task_instructions
        self.similarity_fn_name = "dot" if st_config.get("similarity_fn_name") == "dot" else "cosine"
        self._name = name
        self._revision = revision
        self.work = {"calls": 0, "tokens": 0, "seconds": 0.0}  # the engine calls since ``take_work``

    # ---- metadata -------------------------------------------------------------------------------------------
    @property
    def mteb_model_meta(self):
        """Rebuilt on each access from the engine's current knobs (``mteb.evaluate`` reads it once per call)."""
        return build_model_meta(
            self.engine,
            name=self._name,
            revision=self._revision,
            similarity_fn_name=self.similarity_fn_name,
            use_instructions=bool(self.instructions) or self.use_task_instructions,
            cross_encoder=self.engine_is_cross_encoder,
            experiment_kwargs=self.experiment_kwargs() or None,
        )

    @property
    def engine_is_cross_encoder(self) -> bool:
        return bool(getattr(self.engine, "is_cross_encoder", False))

    def experiment_kwargs(self) -> dict[str, Any]:
        """``{}`` for the plain run (every knob at its default, the model's own prompts, no task instructions);
        otherwise the knob values that can change scores (``result_knobs``), as mteb names experiments, plus the
        prompts and ``task_instructions`` where they apply."""
        if not (knobs_set(self.engine) or self.prompts_given or self.use_task_instructions):
            return {}
        kwargs = result_knobs(self.engine)
        if self.instructions:
            kwargs["prompts"] = dict(sorted(self.instructions.items()))
        if self.use_task_instructions:
            kwargs["task_instructions"] = True
        return kwargs

    def take_work(self) -> dict[str, Any]:
        """The engine calls made through this model since the last ``take_work``: ``calls``, and the ``tokens`` and
        ``seconds`` of the engine's ``stats`` summed over them (0 where the engine keeps no stats); resets them."""
        work, self.work = self.work, {"calls": 0, "tokens": 0, "seconds": 0.0}
        return work

    def _count(self) -> None:
        stats = getattr(self.engine, "stats", None)
        self.work["calls"] += 1
        self.work["tokens"] += int(getattr(stats, "tokens", 0) or 0)
        self.work["seconds"] += float(getattr(stats, "seconds", 0.0) or 0.0)

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
        out = np.asarray(self.engine.embed(texts, **call), dtype=np.float32)
        self._count()
        return out

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
        out = np.asarray(self.engine.score(list(zip(first, second))), dtype=np.float32).reshape(-1)
        self._count()
        return out


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
    return {k: v for k, v in sorted(knobs.items()) if k not in SCHEDULING_KNOBS | IDENTITY_KNOBS and v is not None}


def knobs_set(engine) -> dict[str, Any]:
    """The result-changing knobs set away from their defaults (``lab.engine.knobs.Knobs()``), as set: what makes a
    run a variant rather than the plain run. ``layer`` naming the last layer (``-1``, its number) and an empty
    ``adapters`` list run as the defaults do and are not counted; scheduling knobs (``SCHEDULING_KNOBS``) and the
    model's ``revision`` (``IDENTITY_KNOBS``) never are."""
    from lab.engine.knobs import Knobs

    defaults = dict(Knobs())
    out = {}
    for key, value in dict(engine.knobs).items():
        if key in SCHEDULING_KNOBS or key in IDENTITY_KNOBS:
            continue
        default = defaults.get(key)
        if value == default or (isinstance(default, tuple) and isinstance(value, list) and tuple(value) == default):
            continue
        if key == "adapters" and not value:
            continue
        if key == "layer":
            resolved = getattr(engine, "resolved", None)
            resolved = resolved.get("layer") if isinstance(resolved, Mapping) else None
            if resolved is not None and resolved == getattr(engine, "num_layers", None):
                continue
        out[key] = value
    return out


def build_model_meta(
    engine,
    *,
    name: str | None = None,
    revision: str | None = None,
    similarity_fn_name: str = "cosine",
    use_instructions: bool = False,
    cross_encoder: bool = False,
    experiment_kwargs: Mapping[str, Any] | None = None,
):
    """mteb's ``ModelMeta`` for ``engine``'s model: name, revision, ``n_parameters`` (``count_parameters``),
    ``memory_usage_mb`` (mteb's fp32 rule: 4 bytes a parameter), ``embed_dim``, ``max_tokens`` (the token limit in
    force), ``reference`` (``engine.reference`` where the engine has it, else the Hub page of a hub id; none for
    ``local/...``), and ``license`` / ``languages`` / ``release_date`` from the folder's model card
    (``lab.eval.model_card``). A card value mteb's validation refuses is left out."""
    from mteb.models.model_meta import ModelMeta
    from pydantic import ValidationError

    from lab.eval.model_card import card_fields, read_card

    named_by_engine = name is None
    name = name or model_name(engine)
    max_tokens = getattr(engine, "max_length", None)
    if not isinstance(max_tokens, (int, float)) or isinstance(max_tokens, bool):
        max_tokens = result_knobs(engine).get("max_length")
    fields: dict[str, Any] = {
        "loader": None,
        "name": name,
        "revision": revision or model_revision(engine),
        "release_date": None,
        "languages": None,
        "n_parameters": count_parameters(engine),
        "memory_usage_mb": None,
        "max_tokens": max_tokens,
        "embed_dim": getattr(engine, "embedding_dim", None),
        "license": None,
        "open_weights": True,
        "public_training_code": None,
        "public_training_data": None,
        "framework": ["PyTorch"],
        "reference": engine.reference if named_by_engine and hasattr(engine, "reference") else model_reference(name),
        "similarity_fn_name": similarity_fn_name,
        "use_instructions": use_instructions,
        "training_datasets": None,
        "modalities": ["text"],
        "model_type": ["cross-encoder"] if cross_encoder else ["dense"],
        "experiment_kwargs": experiment_kwargs or None,
    }
    card = card_fields(read_card(model_folder(engine)))
    fields.update(card)
    try:
        meta = ModelMeta(**fields)
    except ValidationError as e:  # a card value mteb does not accept (an unknown license, a bad date): left out
        bad = {str(err["loc"][0]) for err in e.errors() if err.get("loc")}
        if not bad or not bad <= set(card):
            raise
        meta = ModelMeta(**{**fields, **dict.fromkeys(bad)})
    return meta.model_copy(update={"memory_usage_mb": meta.calculate_memory_usage_mb()})


def count_parameters(engine) -> int | None:
    """The parameters of the model the engine loaded: ``engine.n_parameters`` where the engine reports it, else the
    master copy of the weights (``engine.runner.weights.base``), else ``engine.model.parameters()``; ``None`` when
    the engine shows none of them. A checkpoint's tensors the engine does not load (BERT's pooler) are not counted."""
    n = getattr(engine, "n_parameters", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    weights = getattr(getattr(engine, "runner", None), "weights", None)
    base = getattr(weights, "base", None)
    if isinstance(base, Mapping) and base:
        return int(sum(t.numel() for t in base.values()))
    parameters = getattr(getattr(engine, "model", None), "parameters", None)
    if callable(parameters):
        total = sum(p.numel() for p in parameters())
        return int(total) if total else None
    return None


def model_reference(name: str) -> str | None:
    """The Hub page of a hub id (``https://huggingface.co/<org>/<name>``); ``None`` for ``local/...`` names."""
    from lab.models.hub import HUB_PAGE

    return None if name.startswith("local/") else HUB_PAGE + name


def model_folder(engine) -> Path | None:
    """The folder the model was loaded from (``engine.spec.path``, else ``engine.model_path``), or ``None``."""
    path = getattr(getattr(engine, "spec", None), "path", None) or getattr(engine, "model_path", None)
    if not path:
        return None
    path = Path(path)
    return path if path.is_dir() else None


def model_name(engine) -> str:
    """mteb wants ``org/name``; a bare local name becomes ``local/<name>``."""
    name = str(getattr(engine, "model_name", None) or Path(engine.model_path).name)
    name = re.sub(r"[^\w./-]+", "_", name).strip("/")
    return name if "/" in name else f"local/{name}"


def model_revision(engine) -> str:
    """``engine.revision`` (an Engine's: the snapshot's commit, or a local folder's content hash), else the same
    worked out from ``engine.model_path`` (``lab.models.hub``: a hub cache snapshot's commit, or ``local-`` + a hash
    of config.json and samples of the weight files)."""
    rev = getattr(engine, "revision", None)
    if isinstance(rev, str) and rev:
        return rev
    from lab.models.hub import content_revision, snapshot_of

    snap = snapshot_of(engine.model_path)
    return snap[1] if snap else content_revision(engine.model_path)


def _read_json(path: Path) -> dict:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def resolve_tasks(tasks) -> list:
    """Task names, benchmark names, mteb ``Benchmark`` objects or mteb task objects (one or a list) -> task objects,
    in order, a benchmark contributing its tasks as the benchmark defines them. Task names go through
    ``evals.tasks.get_tasks`` (local data) when it can be imported, else ``mteb.get_tasks``; a name that is no task
    but a benchmark ``mteb.get_benchmark`` knows (``"MTEB(eng, v2)"``) stands for its tasks."""
    from mteb.benchmarks.benchmark import Benchmark

    if isinstance(tasks, (str, Benchmark)) or not isinstance(tasks, Iterable):
        tasks = [tasks]
    items: list = []
    for t in tasks:
        if isinstance(t, str):
            bench = _benchmark(t)
            items.extend(bench.tasks if bench is not None else [t])
        elif isinstance(t, Benchmark):
            items.extend(t.tasks)
        else:
            items.append(t)
    names = [t for t in items if isinstance(t, str)]
    if names:
        get_tasks = _local_get_tasks()
        if get_tasks is None:
            import mteb

            def get_tasks(ns):
                found = {t.metadata.name: t for t in mteb.get_tasks(tasks=ns)}
                return [found[n] for n in ns]

        by_name = dict(zip(names, get_tasks(names)))
        items = [by_name[t] if isinstance(t, str) else t for t in items]
    return items


def _benchmark(name: str):
    """The mteb benchmark called ``name`` when ``name`` is not a task name (local or mteb's), else ``None``."""
    import mteb

    from lab._repo import import_evals

    local = import_evals("tasks")
    if local is not None and name in local.LOCAL_TASKS:
        return None
    try:
        return mteb.get_benchmark(name)
    except KeyError:
        return None


def _local_get_tasks():
    """``evals.tasks.get_tasks`` from the repository next to ``lab/``; ``None`` when lab is installed alone."""
    from lab._repo import import_evals

    tasks = import_evals("tasks")
    return None if tasks is None else tasks.get_tasks
