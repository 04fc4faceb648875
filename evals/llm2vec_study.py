"""LLM2Vec on SmolLM2-135M-Instruct: what bidirectional attention buys once the model is trained to use it.

Seven variants of one decoder (``VARIANTS``), scored on STSBenchmark test (Spearman x100 of cosine similarity,
MTEB's STS main score): five with mean pooling (LLM2Vec's choice)

    causal base . bidirectional base . bidirectional + MNTP . bidirectional + MNTP + SimCSE . causal + SimCSE

and the two training-free causal baselines papers put beside LLM2Vec, through the Engine's ``template`` knob: echo
embeddings (the text twice, mean over the second copy; Springer et al. 2024) and PromptEOL (the text in a one-word
prompt, the last token). Each variant's cost is recorded as tokens/s and texts/s of its embedding calls.

The two SimCSE adapters have the same budget (steps, batch, learning rate, text); causal + SimCSE is the control that
asks whether the gain comes from the attention or from the training. Training text (``training_texts``): sentences
of 20 Newsgroups *train* posts and Banking77 *train* utterances (``TEXT_MIX``), so no STS-family set is a source;
every text that also occurs in an evaluation file under ``evals/data`` is removed all the same. A layer sweep
(Spearman vs layer, ``Engine(layer=k)``) follows for the causal base and the best adapted variant. With
``--heldout`` the held-out STS sets (STS12, STS14, STS16, SICK-R) are scored too, for the variants marked
``heldout``. Each distinct sentence is embedded once per variant and layer (``Scorer``); a score whose inputs (model,
adapters, knobs, data, ``lab`` source) are unchanged since the last run is read back from ``results.csv`` /
``layers.csv`` (of ``--out`` and of the default folder) instead.

Writes into ``--out`` (default ``evals/results/llm2vec``): the adapters as PEFT folders ``mntp/``,
``mntp_simcse/``, ``causal_simcse/`` (each with its ``train_log.csv``, ``loss.png``, ``train_config.json``),
``results.csv`` (variant x task), ``layers.csv``, ``variants.png``, ``layers.png``, ``losses.png`` and
``README.md`` with the tables and the command, side by side with the same recipe trained on other text (the
``results_*.csv`` / ``layers_*.csv`` tables named in ``COMPARED``) and with the same text and recipe trained with
other seeds (``seed<N>/``, below: their gains, the mean over seeds and ``seeds.png``). A finished adapter is reused
(when its text, recipe and seed match), an interrupted one resumed, so a second call only does what is missing.

    python evals/llm2vec_study.py --heldout           # the whole study, then the held-out sets
    python evals/llm2vec_study.py --heldout --variants "causal base"      # one variant (trains only what it needs)
    python evals/llm2vec_study.py --heldout --seed 1 --out evals/results/llm2vec/seed1 --sweep "causal base"
                                                      # another training seed, reported beside seed 0 by the next run
    LAB_SMOKE=1 python evals/llm2vec_study.py --out /tmp/llm2vec-smoke     # a few steps, small subsets
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.data_io import DATA, read_jsonl  # after the path set-up: this runs as a script
from evals.results_index import save_file
from lab import env
from lab.models.hub import local_folder

DEFAULT_OUT = ROOT / "evals" / "results" / "llm2vec"
SMOKE = env.flag("LAB_SMOKE", False)
# every file whose text is evaluated somewhere (or is a split of an evaluated set): none of it is trained on. All of
# evals/data's JSON-lines files except the two training sources below.
TRAIN_SOURCES = {"twentynewsgroups": "twentynewsgroups/train.full.jsonl.gz", "banking77": "banking77/train.jsonl.gz"}
# the training-text mix: how many texts each source gives (20 Newsgroups train sentences, Banking77 train
# utterances), sampled with TEXT_SEED; a source left out gives none
TEXT_MIX = {"twentynewsgroups": 4000, "banking77": 1000}
TEXT_SEED = 0
SOURCE_NAMES = {"twentynewsgroups": ("20NG", "sentences"), "banking77": ("Banking77", "utterances")}
SENTENCE_WORDS = (6, 30)  # a kept newsgroup sentence has this many words (inclusive) ...
SENTENCE_CHARS = (30, 200)  # ... and this many characters
HELD_OUT = ("STS12", "STS14", "STS16", "SICK-R")

_QUOTE = re.compile(r"^\s*(>|\||:|\}|#)")  # a quoted line of an earlier post (or a comment-like line)
_ATTRIBUTION = re.compile(r"(\bwrites?:|\bwrote:|\bsays?:|^\s*In article\b|^\s*In <)", re.IGNORECASE)
_HEADER = re.compile(r"^[A-Za-z][A-Za-z-]{1,30}:\s")  # "Archive-name: ...", "Subject: ..." inside a body
_RULE = re.compile(r"^\s*(--|[-=_*~+#]{3,})\s*$")  # "--" opens a signature; a rule of symbols ends the prose
_NET = re.compile(r"://|www\.|@|\b[\w-]+\.(com|edu|org|gov|net|uk|de)\b|\\", re.IGNORECASE)
_SPLIT = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(]?[A-Z])")
_ABBREV = {"mr.", "mrs.", "ms.", "dr.", "st.", "vs.", "jr.", "sr.", "prof.", "no.", "e.g.", "i.e.", "fig.", "vol."}


def _key(s: str) -> str:
    return " ".join(s.lower().split())


def post_sentences(body: str) -> list[str]:
    """The sentences of one newsgroup post body, by a simple rule-based splitter.

    Lines are read up to the signature (a line ``--``) or the first rule of symbols (``----``, ``====``); quoted
    lines (``>``, ``|``, ``:``, ``}``, ``#``), attribution lines ("In article ...", "... writes:"), header-like lines
    ("Archive-name: ...") and table lines (a run of 3+ spaces inside) are dropped. The remaining lines are joined into
    paragraphs (a blank or dropped line ends one), and a paragraph is split after ``.``, ``!`` or ``?`` when the next
    word starts with a capital letter. A sentence is kept when it starts with a capital letter, ends with ``.``,
    ``!`` or ``?`` (not after an abbreviation such as "Mr."), has ``SENTENCE_WORDS`` words and ``SENTENCE_CHARS``
    characters, holds no URL, e-mail address, host name or backslash, and is at least 80 % letters and spaces.
    """
    paragraphs, cur = [], []
    for line in body.splitlines():
        if _RULE.match(line):
            break
        bad = (_QUOTE.match(line) or _ATTRIBUTION.search(line) or _HEADER.match(line)
               or re.search(r"\S\s{3,}\S", line))
        if bad or not line.strip():
            if cur:
                paragraphs.append(" ".join(cur))
            cur = []
        else:
            cur.append(line.strip())
    if cur:
        paragraphs.append(" ".join(cur))
    out = []
    for p in paragraphs:
        for s in _SPLIT.split(" ".join(p.split())):
            words = s.split()
            if not (SENTENCE_WORDS[0] <= len(words) <= SENTENCE_WORDS[1]
                    and SENTENCE_CHARS[0] <= len(s) <= SENTENCE_CHARS[1]):
                continue
            if not (s[0].isupper() and s[-1] in ".!?") or words[-1].lower() in _ABBREV or _NET.search(s):
                continue
            if sum(c.isalpha() or c == " " for c in s) < 0.8 * len(s):
                continue
            out.append(s)
    return out


def evaluation_files() -> list[Path]:
    """Every JSON-lines file under ``evals/data`` except the two training sources: all splits of STSBenchmark,
    STS12/14/16, SICK-R, the test files of Banking77, TwentyNewsgroups and TwitterURLCorpus, SciFact's corpus and
    queries."""
    train = {DATA / f for f in TRAIN_SOURCES.values()}
    files = sorted(p for p in DATA.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")) and p not in train)
    if not files:
        raise FileNotFoundError(f"no evaluation files (*.jsonl, *.jsonl.gz) under {DATA}")
    return files


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)


def evaluation_keys() -> set[str]:
    """Case- and space-folded text of every evaluation file: each string field of each row (lists and nested
    fields included) and each sentence of it as ``post_sentences`` cuts it."""
    keys = set()
    for f in evaluation_files():
        for r in read_jsonl(f):
            for s in _strings(r):
                keys.add(_key(s))
                keys.update(_key(x) for x in post_sentences(s))
    return keys


def _pool(name: str) -> tuple[list[str], dict]:
    """The texts of one training source (with repeats) and its counts: the sentences of the 20 Newsgroups *train*
    posts (``post_sentences``) or the Banking77 *train* utterances (spaces folded)."""
    rows = read_jsonl(DATA / TRAIN_SOURCES[name])
    if name == "twentynewsgroups":
        return [s for p in rows for s in post_sentences(p["body"])], {"20NG train posts": len(rows)}
    return [" ".join(r["text"].split()) for r in rows], {}


def training_texts() -> tuple[list[str], dict]:
    """The training text: ``TEXT_MIX`` texts drawn (seed ``TEXT_SEED``) from the distinct texts of each source
    (``_pool``), after every text that occurs in an evaluation file (``evaluation_keys``, compared case- and
    space-folded) is removed; the sources shuffled together. No STS-family set is a source, so the text is clean by
    construction; the removal makes sure of it. Returns the texts and the counts of each step."""
    import random

    unknown = set(TEXT_MIX) - set(TRAIN_SOURCES)
    if unknown:
        raise ValueError(f"TEXT_MIX names {sorted(unknown)}: the training sources are {sorted(TRAIN_SOURCES)}")
    held = evaluation_keys()
    rng = random.Random(TEXT_SEED)
    texts, counts, seen = [], {}, set()
    for name, n in TEXT_MIX.items():
        pool, first = _pool(name)
        counts.update(first)
        distinct = list({_key(s): s for s in pool[::-1]}.values())  # one spelling of each
        distinct.sort(key=lambda s: _key(s))  # an order that does not depend on the dict's
        clean = [s for s in distinct if _key(s) not in held and _key(s) not in seen]
        if len(clean) < n:
            raise ValueError(f"{name}: {len(clean)} clean texts, fewer than TEXT_MIX[{name!r}] = {n}")
        pick = rng.sample(clean, n)
        seen.update(_key(s) for s in pick)
        texts += pick
        label, unit = SOURCE_NAMES[name]
        counts.update({f"{label} {unit}": len(pool), f"{label} distinct": len(distinct),
                       f"{label} in evaluation files": len(distinct) - len(clean), f"{label} drawn": len(pick)})
    rng.shuffle(texts)
    counts["kept"] = len(texts)
    return texts, counts


def mix_label(mix: dict) -> str:
    """A training-text mix in words: ``{"twentynewsgroups": 4000, "banking77": 1000}`` -> ``20NG 4,000 + Banking77
    1,000``."""
    return " + ".join(f"{SOURCE_NAMES[k][0]} {n:,}" for k, n in mix.items() if n)


def texts_sha1(texts) -> str:
    """The text fingerprint ``lab.adapt`` writes into ``train_config.json`` (``texts_sha1``): SHA-1 of the texts,
    each followed by a NUL byte, first 16 hex digits."""
    import hashlib

    h = hashlib.sha1()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


# the recipe: the same SimCSE budget for both SimCSE variants
RECIPE = {
    "mntp": {"steps": 200, "batch_size": 32, "lr": 5e-4, "mask_rate": 0.2, "max_length": 64},
    "simcse": {"steps": 250, "batch_size": 32, "lr": 3e-4, "temperature": 0.05, "attention_dropout": 0.3,
               "max_length": 64},
    "lora": {"r": 8, "alpha": 16.0, "dropout": 0.05, "save_dtype": "float16"},
}
if SMOKE:
    RECIPE["mntp"]["steps"] = RECIPE["simcse"]["steps"] = 3

# the adapters, in training order: name -> (objective, adapters it is trained on top of, bidirectional)
ADAPTERS = {"mntp": ("mntp", (), True), "mntp_simcse": ("simcse", ("mntp",), True),
            "causal_simcse": ("simcse", (), False)}

# the variants: name -> Engine knobs, ``adapters`` naming folders of ``ADAPTERS`` (stacked in order); a variant with
# ``"heldout": True`` is also scored on the held-out sets (``--heldout``). A new variant is a new line here; any
# Engine knob may be set (mean pooling is the Engine's, for all).
VARIANTS = {
    "causal base": {"bidirectional": False, "adapters": (), "heldout": True},
    "bidirectional base": {"bidirectional": True, "adapters": ()},
    "bidirectional + MNTP": {"bidirectional": True, "adapters": ("mntp",)},
    "bidirectional + MNTP + SimCSE": {"bidirectional": True, "adapters": ("mntp", "mntp_simcse"), "heldout": True},
    "causal + SimCSE": {"bidirectional": False, "adapters": ("causal_simcse",), "heldout": True},
}

# the causal baselines' templates (the Engine's ``template`` knob): echo pools the second copy of the text (mean),
# PromptEOL the prompt's last token
ECHO = "Rewrite the sentence: {text}, rewritten sentence: {text}"
PROMPT_EOL = 'This sentence : "{text}" means in one word:"'
VARIANTS["causal echo"] = {"bidirectional": False, "adapters": (), "template": ECHO, "heldout": True}
VARIANTS["causal PromptEOL"] = {"bidirectional": False, "adapters": (), "template": PROMPT_EOL,
                                "pooling": "lasttoken", "append_eos": False, "heldout": True}

# the Engine every variant runs on; every variant sets the knobs of ``RESET`` (to these values unless it names them)
ENGINE = {"pooling": "mean", "normalize": True, "dtype": "float32"}
RESET = {"pooling": ENGINE["pooling"], "template": None, "append_eos": None}

# the evaluation sets (test pairs with gold scores): task -> files under evals/data, their rows concatenated
SETS = {"STSBenchmark": ("stsbenchmark/test",), "STS12": ("sts12/test",), "STS14": ("sts14/test",),
        "STS16": ("sts16/test",), "SICK-R": ("sickr/train", "sickr/trial", "sickr/test")}


def variants(out: Path) -> dict[str, dict]:
    """Variant name -> the Engine knobs it sets (adapter names resolved to folders under ``out``; the knobs of
    ``RESET`` it does not name at their defaults, so no variant inherits another's)."""
    return {name: {k: (tuple(str(out / a) for a in v) if k == "adapters" else v)
                   for k, v in {**RESET, **spec}.items() if k != "heldout"} for name, spec in VARIANTS.items()}


def train(base: Path, out: Path, seed: int, needed=None, text=None) -> dict[str, float]:
    """The adapters in ``needed`` (default all) and those they build on: skipped when finished on the same text and
    recipe, resumed when interrupted. ``text``: what ``training_texts()`` returns, drawn here when not given.
    Returns seconds per adapter trained."""
    from lab.adapt import LoraSpec, mntp, simcse

    needed = set(ADAPTERS if needed is None else needed)
    for name in list(ADAPTERS)[::-1]:
        if name in needed:
            needed.update(ADAPTERS[name][1])
    if not needed:
        return {}
    texts, counts = text or training_texts()
    print(f"training text: {counts}", flush=True)
    lora = LoraSpec(**RECIPE["lora"])
    seconds = {}
    for name, (objective, below, bidirectional) in ADAPTERS.items():
        if name not in needed:
            continue
        d = out / name
        recipe = RECIPE[objective]
        if (d / "adapter_config.json").exists():
            saved = json.loads((d / "train_config.json").read_text())
            want = {"texts_sha1": texts_sha1(texts), "seed": seed, **recipe}
            stale = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
            if stale:
                raise ValueError(f"{d} was trained on other text or another recipe ({stale}: saved, wanted); "
                                 f"delete the folder to train it again")
            print(f"{name}: finished, reused", flush=True)
            continue
        fit = mntp if objective == "mntp" else simcse
        kw = {} if objective == "mntp" else {"bidirectional": bidirectional}
        t0 = time.perf_counter()
        res = fit(base, texts, d, adapters=[out / a for a in below], lora=lora, seed=seed,
                  resume=(d / "checkpoint").exists(), **kw, **recipe)
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {res.steps} steps ({res.dtype}) in {seconds[name]:.0f} s, final loss {res.final_loss:.3f}",
              flush=True)
    return seconds


def load_sets(tasks, limit: int | None) -> dict[str, list[dict]]:
    """Task -> its pairs (``limit`` evenly spaced ones per task, all when None)."""
    from evals.data_io import spread

    sets = {}
    for task in tasks:
        rows = [r for f in SETS[task] for r in read_jsonl(DATA / f"{f}.jsonl.gz")]
        sets[task] = [rows[i] for i in spread(len(rows), limit)]
    return sets


def _file_hash(path: Path) -> str:
    import hashlib

    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Scorer:
    """Spearman x100 of cosine vs gold (MTEB's STS main score) for one variant at one layer, on several sets at once:
    each distinct sentence is embedded once.

    Every score carries a ``key``: a hash of everything it depends on (the base model's files, the adapters' weight
    and config files, the Engine's arguments and knobs, the layer, the set's data files and ``limit``, the source of
    ``lab`` and ``kernels``, of this scoring code and of the Spearman it uses, and the torch version). A score whose
    key is in ``earlier`` (rows of an earlier results table) is taken from there instead of computed, so a variant
    the training text does not touch (the base model, causal or bidirectional) is scored once, and any change to the
    model, the code or the data scores it again.
    """

    def __init__(self, eng, base: Path, limit: int | None, earlier=None):
        import hashlib
        import inspect

        import torch

        from evals import causal_vs_bidirectional, data_io

        self.eng, self.limit = eng, limit
        self.earlier = {} if earlier is None or "key" not in earlier else {
            k: r for k, r in zip(earlier["key"], earlier.to_dict("records"))}
        h = hashlib.sha1(repr((ENGINE, torch.__version__)).encode())
        for fn in (Scorer.key, Scorer.score, load_sets, causal_vs_bidirectional.spearman, causal_vs_bidirectional.ranks,
                   causal_vs_bidirectional.pearson, data_io.read_jsonl, data_io.spread):
            h.update(inspect.getsource(fn).encode())
        for f in sorted(p for p in base.iterdir() if p.suffix in (".safetensors", ".json", ".gguf", ".bin")):
            h.update(f"{f.name}:{_file_hash(f)}".encode())
        for f in sorted([*(ROOT / "lab").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
            h.update(f"{f.relative_to(ROOT)}:{_file_hash(f)}".encode())
        self._common = h.hexdigest()

    def key(self, knobs: dict, task: str, layer: int | None) -> str:
        import hashlib

        parts = [self._common, repr(sorted((k, v) for k, v in knobs.items() if k != "adapters")), repr(layer),
                 repr(self.limit), *(_file_hash(DATA / f"{f}.jsonl.gz") for f in SETS[task])]
        for a in knobs.get("adapters", ()):
            parts += [_file_hash(Path(a) / f) for f in ("adapter_config.json", "adapter_model.safetensors")]
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]

    def score(self, knobs: dict, tasks, layer: int | None = None) -> list[dict]:
        """One row per task: ``task``, ``spearman_x100``, ``seconds``, ``texts`` and ``tokens`` (of the embedding
        call, shared by the tasks scored together), ``key``, ``reused`` (True when taken from ``earlier``)."""
        import numpy as np

        from evals.causal_vs_bidirectional import spearman

        keys = {t: self.key(knobs, t, layer) for t in tasks}
        rows = {t: {**self.earlier[k], "reused": True} for t, k in keys.items() if k in self.earlier}
        todo = [t for t in tasks if t not in rows]
        if todo:
            sets = load_sets(todo, self.limit)
            sentences = sorted({r[k] for rs in sets.values() for r in rs for k in ("sentence1", "sentence2")})
            where = {s: i for i, s in enumerate(sentences)}
            self.eng.configure(**knobs, layer=layer)
            t0 = time.perf_counter()
            e = self.eng.embed(sentences, show_progress=False)
            seconds = time.perf_counter() - t0
            tokens = self.eng.stats.tokens
            e = e / np.linalg.norm(e, axis=1, keepdims=True).clip(1e-12)
            for t, rs in sets.items():
                a = np.array([where[r["sentence1"]] for r in rs])
                b = np.array([where[r["sentence2"]] for r in rs])
                gold = np.array([float(r["score"]) for r in rs])
                rows[t] = {"spearman_x100": 100 * spearman((e[a] * e[b]).sum(1), gold), "seconds": seconds,
                           "texts": len(sentences), "tokens": tokens, "reused": False}
        fields = ("spearman_x100", "seconds", "texts", "tokens", "reused")
        return [{**{k: rows[t].get(k) for k in fields}, "task": t, "key": keys[t]} for t in tasks]


def evaluate_variants(scorer: Scorer, out: Path, names: list[str], heldout: bool):
    """One row per (variant, task): STSBenchmark test for every variant, the held-out sets too for the variants
    marked ``heldout`` when ``heldout`` is set."""
    import pandas as pd

    rows = []
    for name in names:
        knobs = variants(out)[name]
        tasks = ["STSBenchmark", *(HELD_OUT if heldout and VARIANTS[name].get("heldout") else ())]
        for r in scorer.score(knobs, tasks):
            rows.append({"variant": name, "task": r["task"], "spearman_x100": r["spearman_x100"],
                         "bidirectional": knobs["bidirectional"],
                         "adapters": "+".join(VARIANTS[name]["adapters"]) or "none",
                         "template": VARIANTS[name].get("template") or "", "pooling": knobs["pooling"],
                         "seconds": r["seconds"], "texts": r["texts"], "tokens": r["tokens"],
                         "key": r["key"], "reused": r["reused"]})
            print(f"  {name:32s} {r['task']:13s} {r['spearman_x100']:6.2f}{'  (reused)' * r['reused']}", flush=True)
    return pd.DataFrame(rows)


def layer_sweep(scorer: Scorer, out: Path, names: list[str], layers: list[int]):
    """Spearman x100 on STSBenchmark test after each of ``layers`` (``Engine(layer=k)``: only k layers run)."""
    import pandas as pd

    rows = []
    for name in names:
        for k in layers:
            r = scorer.score(variants(out)[name], ["STSBenchmark"], layer=k)[0]
            rows.append({"variant": name, "layer": k, "spearman_x100": r["spearman_x100"], "seconds": r["seconds"],
                         "key": r["key"], "reused": r["reused"]})
            print(f"  {name:32s} layer {k:2d}: {r['spearman_x100']:6.2f}{'  (reused)' * r['reused']}", flush=True)
    scorer.eng.configure(layer=None)
    return pd.DataFrame(rows, columns=["variant", "layer", "spearman_x100", "seconds", "key", "reused"])


# the same recipe and seed trained on other text, kept for comparison: label -> (results table, layer-sweep table or
# None, what the text was), in the output folder: the ``results.csv`` / ``layers.csv`` this script wrote when that
# text was ``TEXT_MIX`` (for 20NG 4,000 + Banking77 2,500, the scores its run printed). Every text but
# ``STSB_TEXT`` is a clean mix of ``TRAIN_SOURCES``.
STSB_TEXT = "STSB-train text"
COMPARED = {
    STSB_TEXT: (
        "results_stsb_train_text.csv", "layers_stsb_train_text.csv",
        ("the 4,783 distinct sentences of STSBenchmark *train* that occur in no STS evaluation file (scores unused). "
         "STSBenchmark is built from STS 2012-2016 sentences, so that text shares sources (and near-duplicates) with "
         "STS12/14/16 in a way no exact-match filter removes; the 20NG and Banking77 text shares none by "
         "construction")),
    mix_label({"twentynewsgroups": 5000}): (
        "results_20ng_5000.csv", None,
        "drawn as above, 20NG sentences only (no Banking77); its layer sweep was not run"),
    mix_label({"twentynewsgroups": 4000, "banking77": 2500}): (
        "results_20ng_4000_banking77_2500.csv", None,
        ("drawn as above; the scores as that run printed them (two decimals): it stopped before the PromptEOL rows "
         "and the layer sweep")),
}


# the colours of the earlier training texts in the plots (the current text is blue)
_EARLIER_COLOURS = ("#bbbbbb", "#e0b07a", "#a8cfa0", "#c9a9d6")


def plots(results, layers, out: Path, compared: dict | None = None) -> None:
    """``variants.png`` (STSBenchmark per variant; a trained variant also with each earlier text of ``compared``,
    label -> its results table with the layer sweep in ``attrs["layers"]``), ``layers.png`` and ``losses.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
    names = list(sts.index)[::-1]
    trained = {n: bool(VARIANTS.get(n, {}).get("adapters")) for n in names}
    series = [(label, _EARLIER_COLOURS[i % len(_EARLIER_COLOURS)],
               df[df.task == "STSBenchmark"].set_index("variant")["spearman_x100"])
              for i, (label, df) in enumerate(compared.items())]
    series.append((f"{current} (untrained variants: the base)", "#3b75af", sts))
    height = 0.84 / len(series)
    fig, ax = plt.subplots(figsize=(10.5, 1.8 + 0.2 * sum(1 + (len(series) - 1) * trained[n] for n in names)))
    for y, n in enumerate(names):  # the bars a variant has (every text for a trained one), centred on its row
        bars = [(score[n], colour) for i, (_, colour, score) in enumerate(series)
                if n in score.index and (i == len(series) - 1 or trained[n])]
        for j, (v, colour) in enumerate(bars):
            b = ax.barh(y + (len(bars) - 1 - 2 * j) * height / 2, v, height=height, color=colour)
            ax.bar_label(b, fmt="%.1f", padding=3, fontsize=7)
    ax.set_yticks(range(len(names)), names)
    ax.set(xlabel="STSBenchmark test, Spearman x100 (PromptEOL: last token; else mean)")
    ax.set_title("SmolLM2-135M-Instruct: LLM2Vec variants by training text; causal baselines", fontsize=10)
    ax.set_xlim(0, max(60, sts.max() + 10))
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=label) for label, c, _ in series], frameon=False,
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, title="training text", title_fontsize=7)
    fig.tight_layout()
    save_file(out / "variants.png", fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, g) in enumerate(layers.groupby("variant", sort=False)):
        adapted = bool(VARIANTS.get(name, {}).get("adapters"))
        ax.plot(g["layer"], g["spearman_x100"], marker="o", color=("#333333", "#3b75af", "#c0392b", "#7d3c98")[i % 4],
                label=f"{name} ({current})" if adapted else name)
    for i, (label, df) in enumerate(compared.items()):
        for name, g in df.attrs.get("layers", pd.DataFrame(columns=["variant"])).groupby("variant", sort=False):
            if VARIANTS.get(name, {}).get("adapters"):  # the base model does not depend on the training text
                ax.plot(g["layer"], g["spearman_x100"], marker=".", ls="--",
                        color=_EARLIER_COLOURS[i % len(_EARLIER_COLOURS)], label=f"{name} ({label})")
    ax.set(xlabel="layer (0 = embeddings)", ylabel="Spearman x100", title="STSBenchmark test vs layer (mean pooling)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    save_file(out / "layers.png", fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for name in ADAPTERS:
        f = out / name / "train_log.csv"
        if f.exists():
            log = pd.read_csv(f)
            ax.plot(log["step"], log["loss"].rolling(10, min_periods=1).mean(), label=name)
    ax.set(xlabel="step", ylabel="loss (mean of 10 steps)", title="training loss", yscale="log")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(frameon=False)
    fig.tight_layout()
    save_file(out / "losses.png", fig)
    plt.close(fig)


def _fmt(v) -> str:
    import pandas as pd

    return "" if v is None or pd.isna(v) else f"{v:.2f}"


# what the study aims for: bidirectional + MNTP + SimCSE over the causal base, in Spearman points
TARGETS = {"STSBenchmark": 20.0, "STS12": 10.0, "STS14": 10.0, "STS16": 10.0, "SICK-R": 10.0}
TARGET_VARIANT = "bidirectional + MNTP + SimCSE"
CONTROL = "causal + SimCSE"  # the same SimCSE budget with causal attention


def _pivot(results):
    """Variant x task table of Spearman x100, in the order the rows come."""
    return results.pivot_table(index="variant", columns="task", values="spearman_x100", sort=False)


def _verdict(task: str, gain: float) -> str:
    """``STS12 +10.34 (target +10: met)``: a gain of ``TARGET_VARIANT`` against the task's target."""
    return f"{task} {gain:+.2f} (target +{TARGETS[task]:.0f}: {'met' if gain >= TARGETS[task] else 'short'})"


def comparison_lines(results, compared: dict | None = None) -> list[str]:
    """Markdown: the scores per training text (each earlier text of ``compared``, label -> its results table, then
    ``TEXT_MIX``; a variant without adapters once: it is not trained), the gains over the causal base, the targets
    per text, and the best variant per task with its margin over the next."""
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    tasks = list(dict.fromkeys(results.task))

    new = _pivot(results)
    tables = {**{label: _pivot(df) for label, df in compared.items()}, current: new}

    def get(table, variant, task):
        ok = table is not None and variant in table.index and task in table.columns
        return None if not ok or pd.isna(table.loc[variant, task]) else float(table.loc[variant, task])

    def rows(value, fmt=_fmt):
        out = []
        for v in new.index:
            trained = bool(VARIANTS.get(v, {}).get("adapters"))
            for label, t in tables.items() if trained else (("none (not trained)", new),):
                vals = [value(t, v, k) for k in tasks]
                if any(x is not None for x in vals):
                    out.append(f"| {v} | {label} | " + " | ".join(fmt(x) for x in vals) + " |")
        return out

    head = ["| variant | training text | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
    lines = [*head, *rows(get)]
    diffs = [abs(get(old, v, k) - get(new, v, k)) for old in tables.values() if old is not new
             for v in new.index if not VARIANTS.get(v, {}).get("adapters")
             for k in tasks if get(old, v, k) is not None and get(new, v, k) is not None]
    if diffs:
        files = ", ".join(f"`{COMPARED[label][0]}`" if label in COMPARED else label for label in compared)
        lines += ["", (f"The untrained variants, scored here and in {files}: largest difference {max(diffs):.4f} "
                       f"points over {len(diffs)} scores.")]

    def gain(t, v, k):
        a, b = get(t, v, k), get(t, "causal base", k)
        return None if a is None or b is None else a - b

    lines += ["", "Gain over the causal base, Spearman points:", "", *head,
              *[r for r in rows(gain, lambda x: "" if x is None else f"{x:+.2f}")
                if not r.startswith("| causal base |")]]
    lines += ["", f"Targets ({TARGET_VARIANT} over the causal base):", ""]
    for label, t in tables.items():
        parts = [_verdict(k, g) for k in tasks if k in TARGETS and (g := gain(t, TARGET_VARIANT, k)) is not None]
        if parts:
            lines.append(f"- {label}: " + ", ".join(parts))
    lines += ["", f"Best variant per task ({current}), and its margin over the next best:", ""]
    for task in tasks:
        col = new[task].dropna().sort_values(ascending=False)
        if len(col) > 1:
            lines.append(f"- {task}: {col.index[0]} {col.iloc[0]:.2f}, {col.iloc[0] - col.iloc[1]:+.2f} over "
                         f"{col.index[1]} ({col.iloc[1]:.2f})")
    return lines


# other training seeds of the same text and recipe: a run with ``--seed N --out <study folder>/seed<N>`` leaves its
# tables in that subfolder (git keeps its tables, logs and README, not its adapter weights: ``.gitignore``)
_SEED_DIR = re.compile(r"seed(\d+)")


def seed_runs(out: Path, seed: int, results) -> dict:
    """Training seed -> results table: ``results`` (this run's, trained with ``seed``) and the ``results.csv`` of each
    ``seed<N>/`` subfolder of ``out`` (another seed), in seed order."""
    import pandas as pd

    runs = {seed: results}
    for d in out.iterdir():
        if (m := _SEED_DIR.fullmatch(d.name)) and (d / "results.csv").exists() and int(m.group(1)) != seed:
            runs[int(m.group(1))] = pd.read_csv(d / "results.csv")
    return dict(sorted(runs.items()))


def _gains(runs: dict):
    """(seed, variant) x task table of the gains over the causal base (Spearman points) of the trained variants,
    from ``runs`` (seed -> results table)."""
    import pandas as pd

    def one(results):
        t = _pivot(results)
        trained = [v for v in t.index if VARIANTS.get(v, {}).get("adapters")]
        return t.loc[trained] - t.loc["causal base"] if "causal base" in t.index else t.loc[[]]

    return pd.concat({s: one(r) for s, r in runs.items()}, names=["seed", "variant"])


def seed_lines(runs: dict) -> list[str]:
    """Markdown: each trained variant's gain over the causal base per training seed (``runs``: seed -> results
    table), their mean and spread (max - min), and the targets on the mean. Empty for a single seed."""
    import pandas as pd

    if len(runs) < 2:
        return []
    stacked = _gains(runs)
    gains = {s: g.droplevel("seed") for s, g in stacked.groupby(level="seed", sort=False)}
    tasks = list(stacked.columns)
    variants_ = list(dict.fromkeys(stacked.index.get_level_values("variant")))
    mean = stacked.groupby(level="variant", sort=False).mean()
    spread = stacked.groupby(level="variant", sort=False).agg(lambda x: x.max() - x.min())
    seeds = ", ".join(map(str, runs))

    def row(v, label, vals):
        return f"| {v} | {label} | " + " | ".join("" if pd.isna(x) else f"{x:+.2f}" for x in vals) + " |"

    lines = ["## Across training seeds", "",
             (f"The same text and recipe trained with seeds {seeds} (LoRA initialisation, masks, dropout and batch "
              f"order; the text is drawn with seed {TEXT_SEED} in every run). Gain over the causal base, Spearman "
              f"points, per seed, their mean and their spread (max - min):"), "",
             "| variant | seed | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
    for v in variants_:
        lines += [row(v, str(s), g.reindex(columns=tasks).loc[v]) for s, g in gains.items() if v in g.index]
        lines += [row(v, f"mean of {len(runs)}", mean.loc[v]), f"| {v} | spread | "
                  + " | ".join("" if pd.isna(x) else f"{x:.2f}" for x in spread.loc[v]) + " |"]
    if TARGET_VARIANT in mean.index:
        parts = [_verdict(k, g) for k in tasks if k in TARGETS and not pd.isna(g := mean.loc[TARGET_VARIANT, k])]
        lines += ["", f"Targets on the mean of {len(runs)} seeds ({TARGET_VARIANT} over the causal base): "
                  + ", ".join(parts)]
        each = []
        for s in runs:  # a seed is judged only on what it scored: a set it did not score is named, not passed
            g = gains.get(s)
            scored = {k: g.loc[TARGET_VARIANT, k] for k in TARGETS if g is not None and TARGET_VARIANT in g.index
                      and k in g.columns and not pd.isna(g.loc[TARGET_VARIANT, k])}
            short = [f"{k} {x:+.2f}" for k, x in scored.items() if x < TARGETS[k]]
            missing = [k for k in TARGETS if k not in scored]
            said = [f"{what} on {', '.join(tasks_)}" for what, tasks_ in (("short", short), ("not scored", missing))
                    if tasks_]
            each.append(f"seed {s} " + (" and ".join(said) if said else "meets every target"))
        lines += ["", "Each seed on its own: " + "; ".join(each) + "."]
    if {TARGET_VARIANT, CONTROL} <= set(mean.index):
        over = stacked.xs(TARGET_VARIANT, level="variant") - stacked.xs(CONTROL, level="variant")
        parts = [f"{k} " + " / ".join(f"{x:+.2f}" for x in over[k]) + f" (mean {over[k].mean():+.2f})"
                 for k in tasks if over[k].notna().all()]
        lines += ["", f"{TARGET_VARIANT} over {CONTROL} (the same SimCSE budget, causal attention), seed "
                  + " / ".join(map(str, over.index)) + ": " + ", ".join(parts)]
    return lines


def seed_plot(runs: dict, out: Path) -> None:
    """``seeds.png``: per task, the gain over the causal base of ``TARGET_VARIANT`` and ``CONTROL`` (one dot per seed,
    a bar for the mean) and the target (a black dash). Nothing is drawn when ``runs`` holds neither variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacked = _gains(runs)
    shown = [v for v in (TARGET_VARIANT, CONTROL) if v in stacked.index.get_level_values("variant")]
    if not shown:
        return
    tasks = [t for t in stacked.columns if stacked[t].notna().any()]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(shown)
    for i, (v, colour) in enumerate(zip(shown, ("#3b75af", "#999999"))):
        x = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(tasks))]
        per_seed = stacked.xs(v, level="variant").reindex(columns=tasks)
        ax.bar(x, per_seed.mean(), width=width * 0.9, color=colour, alpha=0.55,
               label=f"{v}, mean of {len(per_seed)} seeds")
        for _, g in per_seed.iterrows():
            ax.plot(x, g, "o", color=colour, markersize=4, markeredgecolor="black", markeredgewidth=0.4)
    for j, t in enumerate(t for t in tasks if t in TARGETS):
        ax.hlines(TARGETS[t], tasks.index(t) - 0.45, tasks.index(t) + 0.45, colors="black", linestyles="--",
                  linewidth=1, label="target" if j == 0 else None)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set(ylabel="gain over the causal base, Spearman points",
           title=f"Across training seeds {', '.join(map(str, runs))} (dots: one seed each)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    save_file(out / "seeds.png", fig)
    plt.close(fig)


def write_readme(results, layers, out: Path, counts: dict, seconds: dict, command: str, machine: str,
                 compared: dict | None = None, seed: int = 0, runs: dict | None = None) -> None:
    """``README.md`` in ``out``: the training text, the recipe and ``seed``, the scores and gains beside each earlier
    text of ``compared`` (``comparison_lines``) and each other seed of ``runs`` (``seed_lines``), the cost per
    variant, the layer sweep and the training time per adapter."""
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    source = {"twentynewsgroups": (f"sentences of 20 Newsgroups *train* posts "
                                   f"(`evals/data/{TRAIN_SOURCES['twentynewsgroups']}`, split by `post_sentences`: "
                                   f"quotes, attributions, header-like lines, tables and signatures dropped; "
                                   f"{SENTENCE_WORDS[0]}-{SENTENCE_WORDS[1]} words, {SENTENCE_CHARS[0]}-"
                                   f"{SENTENCE_CHARS[1]} characters; no URL or e-mail address)"),
              "banking77": f"Banking77 *train* utterances (`evals/data/{TRAIN_SOURCES['banking77']}`)"}
    lines = ["# LLM2Vec study: SmolLM2-135M-Instruct, mean pooling", "",
             f"Reproduce: `{command}`", "", f"Machine: {machine}", "",
             "## Training text", "",
             (f"`training_texts()` in `evals/llm2vec_study.py` ({current}): "
              + " and ".join(f"{n:,} {source[k]}" for k, n in TEXT_MIX.items() if n)
              + f", drawn with seed {TEXT_SEED}. No STS-family set is a source. Every text that also occurs in an "
              f"evaluation file (all of `evals/data` but the training sources, 20NG train and Banking77 train: every "
              f"STSBenchmark split, STS12/14/16, SICK-R, the test files of Banking77, TwentyNewsgroups and "
              f"TwitterURLCorpus, SciFact's corpus and queries; each field and each sentence of it, compared case- "
              f"and space-folded) is removed before the draw."),
             "", "Counts: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), ""]
    if compared:
        lines += ["Compared with the same recipe and seed trained on other text (their tables in this folder):", ""]
        for label in compared:
            res, lay, what = COMPARED[label]
            files = ", ".join(f"`{f}`" for f in (res, lay) if f)
            lines.append(f"- {label} ({files}): {what}.")
        tries = 1 + sum(label != STSB_TEXT for label in compared)
        lines += ["", (f"The {tries} clean mixes were compared on the held-out scores below and this study's text "
                       f"({current}) chosen among them, so its held-out numbers are the pick of {tries} tries, not a "
                       "fresh test."), ""]
    lines += [f"Recipe: `{RECIPE}`; training seed {seed}.", "",
             "## Scores", "",
             ("Spearman x100 of cosine similarity vs gold (MTEB's STS main score), each distinct sentence embedded "
              "once; STSBenchmark = its test split, SICK-R = all 9,927 pairs:"), ""]
    lines += comparison_lines(results, compared)
    if across := seed_lines(runs or {}):
        lines += ["", *across, "", "`seeds.png` draws these gains."]
    lines += ["", "## Cost", "", ("Each variant's embedding call over the distinct sentences it scores (STSBenchmark test, "
              "and the held-out sets where scored), on the machine above; echo runs each text twice, PromptEOL "
              "wraps it in its prompt:"), "", "| variant | sets | texts | tokens | seconds | tokens/s | texts/s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, g in results.groupby("variant", sort=False):
        r = g.iloc[0]
        if "tokens" in g and not pd.isna(r.get("tokens")):
            lines.append(f"| {name} | {', '.join(g.task)} | {r.texts:,.0f} | {r.tokens:,.0f} | {r.seconds:.1f} | "
                         f"{r.tokens / r.seconds:,.0f} | {r.texts / r.seconds:,.0f} |")
    swept = {label: {(r.variant, r.layer): r.spearman_x100 for r in df.attrs["layers"].itertuples()}
             for label, df in compared.items() if "layers" in df.attrs}
    lines += ["", "## Layer sweep (STSBenchmark test)", "",
              "| variant | layer | " + " | ".join([*swept, current]) + " |", "|---|---:|" + "---:|" * (len(swept) + 1)]
    lines += [f"| {r.variant} | {r.layer} | " + "".join(f"{_fmt(old.get((r.variant, r.layer)))} | "
                                                         for old in swept.values()) + f"{r.spearman_x100:.2f} |"
              for r in layers.itertuples()]
    lines += ["", ("Training time per adapter (from each `train_log.csv`: the sum of its step times, and the median "
              "step x steps, which discounts steps slowed by other work on the machine; both depend on that load "
              "and on the torch threads, which each `train_config.json` records under `machine`):"), "",
              "| adapter | steps | seconds (sum) | seconds (median step x steps) |", "|---|---:|---:|---:|"]
    for name in ADAPTERS:
        f = out / name / "train_log.csv"
        if f.exists():
            log = pd.read_csv(f)
            lines.append(f"| {name} | {len(log)} | {log.seconds.sum():.0f} | {log.seconds.median() * len(log):.0f} |")
    if seconds:
        lines += ["", "Trained by this command: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())]
    save_file(out / "README.md", "\n".join(lines) + "\n")


def _read_csv(path: Path):
    import pandas as pd

    return pd.read_csv(path) if path.exists() else None


def _merge(fresh, path: Path, on: list[str]):
    """``fresh`` and the rows of the table at ``path`` (read now) that ``fresh`` has no row for, on columns ``on``;
    rows of variants no longer in ``VARIANTS`` are dropped."""
    import pandas as pd

    now = _read_csv(path)
    if now is None or "key" not in now:
        return fresh
    done = set(map(tuple, fresh[on].to_numpy().tolist()))
    keep = [tuple(r) not in done and r[0] in VARIANTS for r in now[on].to_numpy().tolist()]
    return pd.concat([fresh, now[keep]], ignore_index=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, 
                    help="base model folder or hub id (org/name[@revision]; default: the cached "
                         "SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=60 if SMOKE else None, help="evaluation pairs per task")
    ap.add_argument("--heldout", action="store_true",
                    help=f"also score {', '.join(HELD_OUT)} for the variants marked heldout in VARIANTS")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), metavar="NAME",
                    help="score only these variants (and train only the adapters they need), keeping the other "
                         "rows of results.csv and layers.csv; default: all, and the tables hold only them")
    ap.add_argument("--sweep", nargs="*", default=None, choices=list(VARIANTS), metavar="NAME",
                    help="variants of the layer sweep (default: the causal base and the best adapted variant on "
                         "STSBenchmark, those of them scored now); --sweep alone skips the sweep")
    args = ap.parse_args(argv)

    import pandas as pd
    import torch

    from lab import Engine
    from lab.adapt.train import machine_info

    t0 = time.perf_counter()
    if args.model is None:
        from lab.models.gguf import smollm2_path

        args.model = str(smollm2_path())
    base = Path(local_folder(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.variants or list(VARIANTS)
    text = training_texts()  # the adapters' text, and its counts for the README
    seconds = train(base, args.out, args.seed, {a for n in names for a in VARIANTS[n]["adapters"]}, text)
    print(f"training done after {time.perf_counter() - t0:.0f} s", flush=True)

    eng = Engine(str(base), **ENGINE)
    # scores are keyed by everything they depend on, so the study folder's also serve another folder (another seed)
    tables = [f / n for f in dict.fromkeys([args.out.resolve(), DEFAULT_OUT]) for n in ("results.csv", "layers.csv")]
    keyed = [d for d in map(_read_csv, tables) if d is not None and "key" in d]
    scorer = Scorer(eng, base, args.limit, pd.concat(keyed) if keyed else None)
    results = evaluate_variants(scorer, args.out, names, args.heldout)
    if args.variants:  # keep the other rows of the file as it is now (another call may have written it meanwhile)
        results = _merge(results, args.out / "results.csv", ["variant", "task"])
    order = {n: i for i, n in enumerate(VARIANTS)}
    tasks = {t: i for i, t in enumerate(SETS)}
    results = results.sort_values(["variant", "task"], key=lambda s: s.map(order if s.name == "variant" else tasks))
    save_file(args.out / "results.csv", results)

    sweep = args.sweep
    if sweep is None:
        sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
        adapted = sts.drop([n for n in sts.index if not VARIANTS[n]["adapters"]])
        sweep = [n for n in ("causal base", *([adapted.idxmax()] if len(adapted) else [])) if n in names]
    n = eng.model.num_layers
    step = 10 if SMOKE else 3
    layers = layer_sweep(scorer, args.out, sweep, sorted(set(range(0, n + 1, step)) | {n}))
    if args.variants:
        layers = _merge(layers, args.out / "layers.csv", ["variant", "layer"])
        layers = layers.sort_values(["variant", "layer"], key=lambda s: s.map(order) if s.name == "variant" else s)
    save_file(args.out / "layers.csv", layers)

    compared = {}
    for label, (res, lay, _) in COMPARED.items():
        if (df := _read_csv(args.out / res)) is not None:
            if lay and (args.out / lay).exists():
                df.attrs["layers"] = pd.read_csv(args.out / lay)
            compared[label] = df
    plots(results, layers, args.out, compared)
    runs = seed_runs(args.out, args.seed, results)
    if len(runs) > 1:
        seed_plot(runs, args.out)
    counts = text[1]
    m = machine_info()
    machine = f"{m['cpu']}, {m['cores']} cores, torch {torch.__version__}"
    out = args.out.resolve()
    command = ("python evals/llm2vec_study.py" + (" --heldout" if args.heldout else "")
               + (f" --seed {args.seed}" if args.seed else "")
               + ("" if out == DEFAULT_OUT else f" --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
               + ("" if args.sweep is None else " --sweep" + "".join(f' "{n}"' for n in args.sweep)))
    write_readme(results, layers, args.out, counts, seconds, command, machine, compared, args.seed, runs)
    print((args.out / "README.md").read_text())
    print(f"study done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
