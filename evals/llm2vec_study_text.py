"""The LLM2Vec study's training text (``evals/llm2vec_study.py``): ``TEXT_MIX`` texts drawn by ``training_texts``
from sentences of 20 Newsgroups *train* posts (cut by ``post_sentences``) and Banking77 *train* utterances, every text
that also occurs in an evaluation file under ``evals/data`` (``evaluation_files``) removed; the mix in words
(``mix_label``) and the text's fingerprint that each adapter's ``train_config.json`` records (``texts_sha1``)."""

from __future__ import annotations

import re
from pathlib import Path

from evals.data_io import DATA, read_jsonl

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
        bad = _QUOTE.match(line) or _ATTRIBUTION.search(line) or _HEADER.match(line) or re.search(r"\S\s{3,}\S", line)
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
            if not (
                SENTENCE_WORDS[0] <= len(words) <= SENTENCE_WORDS[1]
                and SENTENCE_CHARS[0] <= len(s) <= SENTENCE_CHARS[1]
            ):
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
        counts.update(
            {
                f"{label} {unit}": len(pool),
                f"{label} distinct": len(distinct),
                f"{label} in evaluation files": len(distinct) - len(clean),
                f"{label} drawn": len(pick),
            }
        )
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
