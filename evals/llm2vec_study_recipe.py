"""The LLM2Vec study's recipe (``evals/llm2vec_study.py``): the adapters and their training budget (``RECIPE``,
``ADAPTERS``, trained by ``train``), the variants scored (``VARIANTS``; their Engine knobs by ``variants``), the
Engine they run on (``ENGINE``, ``RESET``) and the evaluation sets (``SETS``, ``HELD_OUT``). ``LAB_SMOKE``
(``SMOKE``) cuts the training to a few steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

from evals.llm2vec_study_text import texts_sha1, training_texts
from lab import env

SMOKE = env.flag("LAB_SMOKE", False)
HELD_OUT = ("STS12", "STS14", "STS16", "SICK-R")

# the recipe: the same SimCSE budget for both SimCSE variants
RECIPE = {
    "mntp": {"steps": 200, "batch_size": 32, "lr": 5e-4, "mask_rate": 0.2, "max_length": 64},
    "simcse": {
        "steps": 250,
        "batch_size": 32,
        "lr": 3e-4,
        "temperature": 0.05,
        "attention_dropout": 0.3,
        "max_length": 64,
    },
    "lora": {"r": 8, "alpha": 16.0, "dropout": 0.05, "save_dtype": "float16"},
}
if SMOKE:
    RECIPE["mntp"]["steps"] = RECIPE["simcse"]["steps"] = 3

# the adapters, in training order: name -> (objective, adapters it is trained on top of, bidirectional)
ADAPTERS = {
    "mntp": ("mntp", (), True),
    "mntp_simcse": ("simcse", ("mntp",), True),
    "causal_simcse": ("simcse", (), False),
}

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
VARIANTS["causal PromptEOL"] = {
    "bidirectional": False,
    "adapters": (),
    "template": PROMPT_EOL,
    "pooling": "lasttoken",
    "append_eos": False,
    "heldout": True,
}

# the Engine every variant runs on; every variant sets the knobs of ``RESET`` (to these values unless it names them)
ENGINE = {"pooling": "mean", "normalize": True, "dtype": "float32"}
RESET = {"pooling": ENGINE["pooling"], "template": None, "append_eos": None}

# the evaluation sets (test pairs with gold scores): task -> files under evals/data, their rows concatenated
SETS = {
    "STSBenchmark": ("stsbenchmark/test",),
    "STS12": ("sts12/test",),
    "STS14": ("sts14/test",),
    "STS16": ("sts16/test",),
    "SICK-R": ("sickr/train", "sickr/trial", "sickr/test"),
}


def variants(out: Path) -> dict[str, dict]:
    """Variant name -> the Engine knobs it sets (adapter names resolved to folders under ``out``; the knobs of
    ``RESET`` it does not name at their defaults, so no variant inherits another's)."""
    return {
        name: {
            k: (tuple(str(out / a) for a in v) if k == "adapters" else v)
            for k, v in {**RESET, **spec}.items()
            if k != "heldout"
        }
        for name, spec in VARIANTS.items()
    }


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
                raise ValueError(
                    f"{d} was trained on other text or another recipe ({stale}: saved, wanted); "
                    f"delete the folder to train it again"
                )
            print(f"{name}: finished, reused", flush=True)
            continue
        fit = mntp if objective == "mntp" else simcse
        kw = {} if objective == "mntp" else {"bidirectional": bidirectional}
        t0 = time.perf_counter()
        res = fit(
            base,
            texts,
            d,
            adapters=[out / a for a in below],
            lora=lora,
            seed=seed,
            resume=(d / "checkpoint").exists(),
            **kw,
            **recipe,
        )
        seconds[name] = time.perf_counter() - t0
        print(
            f"{name}: {res.steps} steps ({res.dtype}) in {seconds[name]:.0f} s, final loss {res.final_loss:.3f}",
            flush=True,
        )
    return seconds
