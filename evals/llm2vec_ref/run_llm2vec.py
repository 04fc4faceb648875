"""Embeddings from the official llm2vec, run inside the reference environment (``evals/llm2vec_ref``).

Reads a job (JSON) naming the model folder (or hub id), an optional PEFT folder (or id), the settings (none: the
call llm2vec's users make, the folders deciding) and the inputs (``[[instruction, text], ...]``, llm2vec's format),
writes the embeddings (``.npy``, float32, input order) and a report (JSON: seconds, versions, the settings llm2vec
ended with, and every warning or log record about adapter keys peft / transformers emitted while loading). Imports
nothing from prefill-lab.

    <venv>/bin/python evals/llm2vec_ref/run_llm2vec.py job.json
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
import time
import warnings

import numpy as np
import torch

KEY_WORDS = re.compile(r"missing adapter keys|missing keys|unexpected keys", re.IGNORECASE)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(job_file: str) -> int:
    from importlib.metadata import version

    import peft
    import transformers
    from llm2vec import LLM2Vec

    # peft 0.21 reads torch.distributed.tensor.DTensor, a submodule torch 2.13 does not import with torch.distributed
    # (and transformers 4.44 never imports it): import it, or wrapping any Linear fails with an AttributeError
    importlib.import_module("torch.distributed.tensor")

    with open(job_file) as f:
        job = json.load(f)
    torch.manual_seed(0)
    handler = Records()
    for name in ("", "transformers", "peft", "llm2vec"):
        logging.getLogger(name).addHandler(handler)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a job without settings calls llm2vec as its users do: the folders decide the rest
        settings = {"enable_bidirectional": job["bidirectional"]} if "bidirectional" in job else {}
        if job.get("merge_peft"):
            settings["merge_peft"] = True
        l2v = LLM2Vec.from_pretrained(
            job["model"],
            peft_model_name_or_path=job.get("peft"),
            torch_dtype=torch.float32,
            **settings,
            **job.get("encoder", {}),
        )
    load_s = time.perf_counter() - t0
    # a log record can reach the handler twice (on a logger and its parent): those are counted once; two warnings
    # with one text (each adapter's missing keys) are two
    messages = [str(w.message) for w in caught] + list(dict.fromkeys(handler.messages))
    about_keys = [m for m in messages if KEY_WORDS.search(m)]
    t0 = time.perf_counter()
    with torch.no_grad():
        emb = l2v.encode(
            job["inputs"],
            batch_size=job.get("batch_size", 32),
            show_progress_bar=False,
            convert_to_tensor=True,
            device="cpu",
        )
    encode_s = time.perf_counter() - t0
    np.save(job["out"], emb.float().numpy())
    report = {
        "load_seconds": load_s,
        "encode_seconds": encode_s,
        "key_messages": about_keys,
        "missing_adapter_keys": sum(len(re.findall(r"lora_[AB]", m)) for m in about_keys if "missing" in m.lower()),
        "versions": {
            "llm2vec": version("llm2vec"),
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "torch": torch.__version__,
        },
        "config": {
            "pooling_mode": l2v.pooling_mode,
            "max_length": l2v.max_length,
            "doc_max_length": l2v.doc_max_length,
            "skip_instruction": l2v.skip_instruction,
            # the name its chat template is chosen by, and the model class (bidirectional or not)
            "name_or_path": l2v.model.config._name_or_path,
            "model_class": type(l2v.model).__name__,
        },
    }
    with open(job["report"], "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
