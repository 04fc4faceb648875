"""Knob sweeps over mteb tasks -> one tidy DataFrame (``lab.evaluate`` is this module's ``evaluate``).

``evaluate(engine, tasks, sweep=...)`` runs every combination of the swept knob values through
``engine.configure`` (live, no reload), evaluates each task with mteb through
:func:`lab.eval.mteb_adapter.as_mteb_model`, restores the original knobs, and returns one row per (variant, task,
split, subset, metric). ``tasks`` may name tasks, a benchmark (``"MTEB(eng, v2)"``, any name ``mteb.get_benchmark``
knows) or hold mteb task / Benchmark objects.

Results go through mteb's ResultCache (``evals/results/cache`` or ``$LAB_MTEB_CACHE``) in its standard layout: the
plain run (knobs at their defaults) in ``<cache>/results/<org__name>/<revision>/<Task>.json`` with
``model_meta.json``, the folder ``mteb.ResultCache(cache).load_results(models=[name])`` and the leaderboard read;
each variant (a swept or set knob away from its default) apart, under ``.../<revision>/experiments/<knobs>/``
(``lab.eval.mteb_adapter``). A rerun, or a run started again after it was killed, only evaluates the tasks (and
splits) the cache does not hold. Each result file is written whole (mteb writes it into a temporary folder, then it
is moved into place), so a full disk or a killed run leaves the results written before readable; a result file
found damaged is named in a warning and computed again. A task whose data cannot be loaded (offline and not in the
datasets cache, say) is skipped with the reason while the others run.

``task_table(df)`` (also ``df.attrs["tasks"]``) has one row per (variant, task): its main score, whether it was
computed, read from the cache or skipped (and why), and the engine's tokens, seconds and tokens/s over the task's
encode calls.

    >>> df = evaluate(engine, ["STSBenchmark"], sweep={"pooling": ["mean", "cls"], "bidirectional": [False, True]})
    >>> df[df.main].pivot_table(index="variant", columns="task", values="score")
    >>> task_table(evaluate(engine, "MTEB(eng, v2)"))
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab import env
from lab._files import NO_ROOM, make_folder, write_failed
from lab._warn import warn
from lab.eval.mteb_adapter import as_mteb_model, model_name, resolve_tasks

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_CACHE = "default"  # the cache argument meaning default_cache_dir()
STAGING = ".partial-"  # <cache>/.partial-<pid>/: where mteb writes a result before it is moved into place
CACHE_FIX = (
    "point cache= (evals.run --cache, $LAB_MTEB_CACHE) at a folder that can be written; a rerun computes "
    "only the results the cache lacks"
)
_NOT_METRICS = frozenset({"hf_subset", "languages", "main_score", "mteb_version"})
FIXED_COLUMNS = ("model", "variant")
RESULT_COLUMNS = ("task", "split", "subset", "metric", "score", "main")
TASK_COLUMNS = ("model", "variant", "task", "status", "score", "tokens", "seconds", "tokens_per_s", "reason")


def default_cache_dir() -> Path:
    """``$LAB_MTEB_CACHE``, else ``evals/results/cache`` in the repository (or the working directory)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "evals").is_dir():
        root = Path.cwd()
    return env.path("LAB_MTEB_CACHE", root / "evals" / "results" / "cache", folder=True)


def resolve_cache(cache: Any = DEFAULT_CACHE):
    """``ResultCache`` from a path, an existing ResultCache, the default (sentinel) or ``None`` (no caching). A path,
    the default or a plain ``mteb.ResultCache`` becomes a ``result_cache_class()`` on that folder (results written
    whole, a damaged one computed again), its ``results`` folder made here: a file in the way is named before any
    work. A ResultCache of another subclass is used as it is."""
    import mteb

    if cache is None or (isinstance(cache, mteb.ResultCache) and type(cache) is not mteb.ResultCache):
        return cache
    if isinstance(cache, mteb.ResultCache):
        cache = cache.cache_path
    path = default_cache_dir() if cache is DEFAULT_CACHE else Path(cache)
    make_folder(path / "results", "mteb's result cache", CACHE_FIX)
    return result_cache_class()(path)


@functools.cache
def result_cache_class() -> type:
    """mteb's ``ResultCache`` made safe to stop at any point (the class is built on first use, as mteb is imported
    late). mteb writes a result with ``open(path, "w")``, so a full disk or a kill in the middle leaves a truncated
    JSON in place of the result that was there, which the next run then fails to read. This subclass:

    - ``save_to_cache``: mteb writes the result (the task's JSON, ``model_meta.json``, ``run_settings.jsonl``) into
      ``<cache>/.partial-<pid>/``, and each file is then moved into place whole (``os.replace``), the task's JSON
      last. A write that fails raises an ``OSError`` naming the folder, about how many bytes and the fix, the
      results already there left as they were; a killed run's ``.partial-<pid>`` folder is removed by the next.
    - ``load_task_result``: a result file that cannot be read (truncated, edited) is named in a warning and taken
      as missing, so mteb computes that task again and replaces the file.
    """
    import mteb

    class SafeResultCache(mteb.ResultCache):
        def __init__(self, cache_path=None) -> None:
            super().__init__(cache_path)
            for stale in self.cache_path.glob(f"{STAGING}*"):
                if not _running(stale.name.removeprefix(STAGING)):
                    shutil.rmtree(stale, ignore_errors=True)

        def save_to_cache(self, task_result, model_name, model_revision=None, *, encode_kwargs=None) -> None:
            final = self.get_task_result_path(task_result.task_name, model_name, model_revision)
            make_folder(final.parent, f"mteb's result of {task_result.task_name}", CACHE_FIX)
            root = self.cache_path / f"{STAGING}{os.getpid()}"
            try:
                stage = mteb.ResultCache(root)
                staged = stage.get_task_result_path(task_result.task_name, model_name, model_revision)
                staged.parent.mkdir(parents=True, exist_ok=True)
                settings = final.parent / "run_settings.jsonl"  # mteb merges the new run's settings into it
                if settings.is_file():
                    shutil.copyfile(settings, staged.parent / settings.name)
                stage.save_to_cache(task_result, model_name, model_revision, encode_kwargs=encode_kwargs)
                for f in sorted(staged.parent.iterdir(), key=lambda f: f == staged):  # the result itself last
                    if f.is_file():
                        os.replace(f, final.parent / f.name)
            except OSError as e:
                size = len(task_result.model_dump_json(indent=2))  # about what mteb writes
                raise write_failed(e, final, size, f"{NO_ROOM}, or {CACHE_FIX}") from e
            finally:
                shutil.rmtree(root, ignore_errors=True)

        def load_task_result(
            self,
            task_name,
            model_name,
            model_revision=None,
            raise_if_not_found=False,
            prioritize_remote=False,
            experiment_name=None,
        ):
            try:
                return super().load_task_result(
                    task_name, model_name, model_revision, raise_if_not_found, prioritize_remote, experiment_name
                )
            except (ValueError, KeyError, TypeError) as e:  # json's and pydantic's errors are ValueErrors
                path = self.get_task_result_path(
                    task_name, model_name, model_revision, experiment_name=experiment_name
                )
                reason = " ".join(str(e).split())[:200]
                warn(
                    f"the cached mteb result {path} is damaged and cannot be read ({type(e).__name__}: "
                    f"{reason}); {task_name} is computed again and the file replaced",
                )
                return None

    return SafeResultCache


def _running(pid: str) -> bool:
    """Whether the process ``pid`` (a number as text) is running; False for text that is no number."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def variants(sweep: Mapping[str, Iterable] | None) -> list[dict[str, Any]]:
    """Every combination of the swept values, first knob varying slowest; ``[{}]`` without a sweep."""
    if not sweep:
        return [{}]
    keys = list(sweep)
    values = [list(sweep[k]) if not isinstance(sweep[k], (str, bytes)) else [sweep[k]] for k in keys]
    for k, v in zip(keys, values):
        if not v:
            raise ValueError(f"sweep[{k!r}] is empty")
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def variant_name(variant: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "default"


def evaluate(
    engine,
    tasks,
    *,
    sweep: Mapping[str, Iterable] | None = None,
    cache: Any = DEFAULT_CACHE,
    instructions: Mapping[str, str] | None = None,
    use_task_instructions: bool = False,
    overwrite: bool = False,
    encode_kwargs: Mapping[str, Any] | None = None,
    show_progress: bool = True,
    retrieval_modes: Iterable[str] = (),
) -> pd.DataFrame:
    """Evaluate ``engine`` on ``tasks`` for every variant of ``sweep``; see the module docstring.

        >>> df = evaluate(eng, ["STSBenchmark"], sweep={"pooling": ["mean", "cls"]})
        >>> df[df.main][["variant", "task", "score"]]

    Args:
        tasks: task names (local data first, see ``evals.tasks.get_tasks``), benchmark names (``mteb.get_benchmark``),
            mteb task or Benchmark objects, or one of them.
        sweep: ``{knob: [values]}``; each combination is applied with ``engine.configure`` and the knobs are
            restored afterwards, even on error.
        cache: a folder, an ``mteb.ResultCache``, or ``None`` for no cache. Default ``evals/results/cache``
            (``$LAB_MTEB_CACHE`` overrides). Each result is written whole (``result_cache_class``): a write that
            fails is an ``OSError`` naming the folder, the results there before left whole, and a damaged result
            file is named in a warning and computed again.
        instructions / use_task_instructions: prompts per task / prompt type, see ``as_mteb_model``.
        overwrite: re-run even when the cache holds results.
        retrieval_modes: on every retrieval task, also score these ``lab.eval.retrieval`` modes (``sparse``,
            ``late-interaction``, ``tokens-maxsim``, ``m3``, ``late-chunking``, ``chunks``; ``dense`` recomputes
            mteb's with our nDCG) with nDCG@10 on the task's own qrels: rows whose variant ends in ``,mode=<mode>``,
            metric ``ndcg_at_10`` (mteb does not score these representations; they are named apart). Checked
            against the model's heads before anything runs.

    Returns:
        DataFrame with columns model, variant, one column per knob, task, split, subset, metric, score (mteb's
        scale, e.g. 0.82 for Spearman 82), main (True on each task's main-score row). ``df.attrs["tasks"]``: one
        record per (variant, task) with its status (``computed``, ``cached`` or ``skipped``, with the ``reason``),
        main score and tokens/s (``task_table`` makes it a DataFrame). A skipped task has no rows.
    """
    import mteb
    import pandas as pd
    from tqdm.auto import tqdm

    from lab.eval.retrieval import check_modes

    task_list = resolve_tasks(tasks)
    combos = variants(sweep)
    original = dict(engine.knobs)
    unknown = sorted({k for combo in combos for k in combo} - set(original))
    if unknown:
        raise ValueError(f"cannot sweep unknown knob(s) {', '.join(unknown)}; knobs: {', '.join(original)}")
    validate = getattr(engine, "validate", None)
    if validate is not None:  # every variant checked before any runs: a bad value fails now, not after hours
        for combo in combos:
            try:
                validate(**combo)
            except (TypeError, ValueError) as e:
                raise type(e)(f"sweep variant {variant_name(combo)}: {e}") from None
    modes = check_modes(engine, retrieval_modes)  # known and servable, before any work
    result_cache = resolve_cache(cache)
    rows: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    bar = tqdm(total=len(combos) * len(task_list), desc="evaluate", disable=not show_progress)
    try:
        with _quiet_superseded():
            for combo in combos:
                if combo:
                    engine.configure(**combo)
                model = as_mteb_model(engine, instructions=instructions, use_task_instructions=use_task_instructions)
                base = {"model": model_name(engine), "variant": variant_name(combo), **engine.knobs}
                for task in task_list:
                    name = task.metadata.name
                    bar.set_description(f"{variant_name(combo)} | {name}")
                    model.take_work()
                    record = {"model": base["model"], "variant": base["variant"], "task": name}
                    try:
                        with _data_guard(task):
                            result = mteb.evaluate(
                                model,
                                task,
                                cache=result_cache,
                                overwrite_strategy="always" if overwrite else "only-missing",
                                encode_kwargs={"batch_size": 32, "show_progress_bar": False, **(encode_kwargs or {})},
                                show_progress_bar=False,
                            )
                    except DataUnavailable as e:
                        done.append(_record(record, "skipped", reason=str(e)))
                        if show_progress:
                            bar.write(f"skipped {name}: {e}")
                        bar.update()
                        continue
                    if result.exceptions:  # mteb's own skip (a private dataset it cannot read)
                        reason = "; ".join(str(getattr(x, "exception", x)) for x in result.exceptions)
                        done.append(_record(record, "skipped", reason=reason))
                        bar.update()
                        continue
                    work = model.take_work()
                    for task_result in result.task_results:
                        rows.extend({**base, **r} for r in score_rows(task_result, task.metadata.main_score))
                    done.append(
                        _record(
                            record,
                            "computed" if work["calls"] else "cached",
                            work=work,
                            score=_main_score(result.task_results),
                        )
                    )
                    if modes and task.metadata.type == "Retrieval":
                        rows.extend({**base, **r} for r in _mode_rows(engine, task, modes, variant_name(combo)))
                    bar.update()
    finally:
        bar.close()
        restore = {k: original[k] for k in {k for combo in combos for k in combo}}
        if restore:
            engine.configure(**restore)
    columns = [*FIXED_COLUMNS, *original, *RESULT_COLUMNS]
    df = pd.DataFrame(rows, columns=columns)
    df.attrs["tasks"] = done
    return df


class DataUnavailable(RuntimeError):
    """A task's data could not be loaded (the message says why); ``evaluate`` skips the task."""


@contextlib.contextmanager
def _data_guard(task):
    """Within: a failure of ``task.load_data`` (or, for an aggregate task, of one of its tasks') raises
    ``DataUnavailable`` with the reason, so it can be told from a failure of the model. The tasks are left as they
    were."""
    tasks = [task, *(getattr(task.metadata, "tasks", None) or [])]
    patched = []
    for t in tasks:
        if "load_data" in vars(t):
            continue
        t.load_data = _guarded(t.load_data)
        patched.append(t)
    try:
        yield
    finally:
        for t in patched:
            del t.load_data


def _guarded(load_data):
    def load(*args, **kwargs):
        try:
            return load_data(*args, **kwargs)
        except Exception as e:  # any failure to get the data means the task cannot run here
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DataUnavailable(f"data not available ({type(e).__name__}: {reason[:300]})") from e

    return load


def _record(
    record: dict[str, Any], status: str, *, work: Mapping[str, Any] | None = None, score=None, reason: str = ""
) -> dict[str, Any]:
    tokens, seconds = (int(work["tokens"]), float(work["seconds"])) if work else (0, 0.0)
    return {
        **record,
        "status": status,
        "score": score,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
        "reason": reason,
    }


def _main_score(task_results) -> float | None:
    """The task's main score as mteb aggregates it (the mean over its splits and subsets)."""
    scores = []
    for task_result in task_results:
        try:
            scores.append(float(task_result.get_score()))
        except (KeyError, TypeError, ValueError):
            continue
    return sum(scores) / len(scores) if scores else None


def task_table(df) -> pd.DataFrame:
    """``evaluate``'s per-task record (``df.attrs["tasks"]``) as a DataFrame, columns ``TASK_COLUMNS``: model,
    variant, task, status (``computed`` / ``cached`` / ``skipped``), score (the main score, mteb's scale), tokens,
    seconds and tokens_per_s of the engine calls the task made (0 / empty when read from the cache), reason (why
    a task was skipped)."""
    import pandas as pd

    return pd.DataFrame(list(df.attrs.get("tasks", [])), columns=list(TASK_COLUMNS))


def _mode_rows(engine, task, modes: tuple[str, ...], variant: str) -> list[dict[str, Any]]:
    from lab.eval.retrieval import evaluate_retrieval, load_retrieval

    corpus, queries, qrels = load_retrieval(task)
    df = evaluate_retrieval(engine, corpus, queries, qrels, modes=modes, task=task.metadata.name)
    return [
        {
            "variant": f"{variant},mode={r.mode}",
            "task": r.task,
            "split": "test",
            "subset": "default",
            "metric": r.metric,
            "score": r.score,
            "main": True,
        }
        for r in df.itertuples()
    ]


class _DropSuperseded(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is superseded by" not in record.getMessage()


@contextlib.contextmanager
def _quiet_superseded():
    """mteb warns on every run of a superseded task (STSBenchmark -> .v2 ...); a sweep asked for it by name.
    Also hides the datasets progress bars for the duration, so only the sweep's own bar shows."""
    import datasets

    logger, flt = logging.getLogger("mteb.abstasks.abstask"), _DropSuperseded()
    logger.addFilter(flt)
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # mteb's per-task dataset.map bars would break up our variants x tasks bar
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is superseded by")
            yield
    finally:
        logger.removeFilter(flt)
        if bars_were_on:
            datasets.enable_progress_bars()


def score_rows(task_result, main_metric: str) -> list[dict[str, Any]]:
    """One dict per (split, subset, metric) of an mteb TaskResult; nested dicts flatten to ``a.b`` names, lists
    (per-experiment scores) are left out."""
    rows = []
    for split, entries in task_result.scores.items():
        for entry in entries:
            subset = entry.get("hf_subset", "default")
            for metric, value in _flatten(entry):
                rows.append(
                    {
                        "task": task_result.task_name,
                        "split": split,
                        "subset": subset,
                        "metric": metric,
                        "score": value,
                        "main": metric == main_metric,
                    }
                )
    return rows


def _flatten(entry: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for key, value in entry.items():
        if not prefix and key in _NOT_METRICS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix=f"{name}.")
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, (int, float)):
            yield name, float(value)
