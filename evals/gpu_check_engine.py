"""The model sections of ``evals/gpu_check.py``: ``check_engine`` (``lab.Engine(...).embed`` on the triton and torch
attention backends against ``SentenceTransformer.encode``: time, texts/s and the embeddings' cosine agreement) and
``check_decoder`` (a random Llama through the Engine against transformers), with their texts (``load_texts``)."""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

from evals.gpu_check_harness import Check

STSB_TEST = Path(__file__).resolve().parent / "data" / "stsbenchmark" / "test.jsonl.gz"


# ------------------------------------------------------------------------------------------------------ engine
def load_texts(n: int) -> tuple[list[str], str]:
    """STSBenchmark test sentences (repeated up to ``n``), else synthetic sentences of varied length."""
    path = STSB_TEST
    texts, source = [], "synthetic"
    if path.exists():
        from evals.data_io import read_jsonl

        texts = [s for rec in read_jsonl(path) for s in (rec["sentence1"], rec["sentence2"])]
        source = f"stsbenchmark test ({len(texts)} sentences)"
    if not texts:
        words = [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "researchers",
            "measure",
            "prefill",
            "throughput",
        ]
        texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 40)) for i in range(2000)]
    out = (texts * (n // len(texts) + 1))[:n]
    return out, source


def check_engine(ck: Check, n_texts: int, st_batch: int, model: str | None = None) -> None:
    torch = ck.torch
    import numpy as np

    from lab import Engine

    path = model
    if path is None:
        from lab._extras import minilm_path

        path = minilm_path()
    from lab.models.hub import local_folder

    path = local_folder(path)  # a hub id: its snapshot folder (sentence-transformers loads the same files)
    texts, source = load_texts(n_texts)
    dtype = "bfloat16" if ck.device == "cuda" else "float32"
    config = f"{'all-MiniLM-L6-v2' if model is None else Path(path).name}, {len(texts)} texts from {source}"
    runs = 3 if not ck.smoke else 1
    results, embs = {}, {}

    def timed(provider, fn):
        fn(texts[: min(256, len(texts))])  # warm-up: compile kernels, allocator, tokenizer caches
        ck.sync()
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            emb = fn(texts)
            ck.sync()
            times.append(time.perf_counter() - t)
        results[provider] = statistics.median(times)
        embs[provider] = np.asarray(emb, dtype=np.float32)

    for backend in ("triton", "torch"):
        with ck.guard("engine", f"Engine attention_backend={backend}"):
            eng = Engine(path, dtype=dtype, device=ck.device, attention_backend=backend)
            timed(f"engine_{backend}", eng.embed)
            del eng
    with ck.guard("engine", "SentenceTransformer.encode"):
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device=ck.device)
        st.to(getattr(torch, dtype))
        timed("sentence_transformers", functools.partial(st.encode, batch_size=st_batch, convert_to_numpy=True))

    base = results.get("sentence_transformers")
    for provider, secs in results.items():
        ck.add(
            section="engine",
            kernel="embed",
            provider=provider,
            config=config,
            dtype=dtype,
            metric="s",
            value=secs,
            p50=secs,
            baseline="sentence_transformers" if base else "",
            speedup=base / secs if base else "",
        )
        ck.add(
            section="engine",
            kernel="embed",
            provider=provider,
            config=config,
            dtype=dtype,
            metric="texts_per_s",
            value=len(texts) / secs,
        )
    if "sentence_transformers" in embs:
        ref_emb = embs["sentence_transformers"]
        ref_emb = ref_emb / np.linalg.norm(ref_emb, axis=1, keepdims=True).clip(1e-12)
        for provider in ("engine_triton", "engine_torch"):
            if provider in embs:
                e = embs[provider] / np.linalg.norm(embs[provider], axis=1, keepdims=True).clip(1e-12)
                cos = (e * ref_emb).sum(1)
                bound = 0.99 if dtype == "bfloat16" else 0.9999
                ck.add(
                    section="engine",
                    kernel="embed",
                    provider=provider,
                    config=config,
                    dtype=dtype,
                    metric="min_cosine_vs_st",
                    value=float(cos.min()),
                    bound=bound,
                    ok=bool(cos.min() >= bound),
                )


# ----------------------------------------------------------------------------------------------------- decoder
def check_decoder(ck: Check, tokenizer_from: str | None) -> None:
    """A random Llama (grouped-query attention, head size 64, 4 layers) through the engine on the GPU, both attention
    backends, mean pooling, against transformers' float32 forward on the same device, in float32 and bfloat16, on
    short sentences and a few joined ones (~200 tokens). The tokenizer is all-MiniLM-L6-v2's (any works for random
    weights). (The ``pairs`` rotary layout is a CPU choice made at load; the rotary section checks its rotation.)"""
    torch = ck.torch
    import tempfile

    import numpy as np
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from evals.criteria import min_cosine
    from lab import Engine

    if tokenizer_from is None:
        from lab._extras import minilm_path

        tokenizer_from = minilm_path()
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    small = ck.smoke
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64 if small else 512,
        intermediate_size=96 if small else 1408,
        num_hidden_layers=2 if small else 4,
        num_attention_heads=4 if small else 8,
        num_key_value_heads=2,
        head_dim=16 if small else 64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    folder = Path(tempfile.mkdtemp()) / "llama-random"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    sentences, _ = load_texts(8 if small else 96)
    texts = sentences + [" ".join(sentences[i : i + 24]) for i in range(0, len(sentences) - 23, 24)]
    reference = model.model.to(ck.device)
    config = (
        f"random Llama h={cfg.hidden_size} L={cfg.num_hidden_layers} Hq={cfg.num_attention_heads} "
        f"Hkv={cfg.num_key_value_heads} D={cfg.head_dim}, {len(texts)} texts"
    )
    want = None
    for dtype in ("float32",) if small else ("float32", "bfloat16"):  # the interpreter lacks bfloat16 math
        for backend in ("triton", "torch"):
            with ck.guard("decoder", f"Engine on {ck.device}, {backend}, {dtype}"):
                eng = Engine(str(folder), pooling="mean", dtype=dtype, device=ck.device, attention_backend=backend)
                requests = eng.tokenize(texts)
                if want is None:  # the float32 reference, one text at a time, mean over its tokens
                    with torch.no_grad():
                        want = np.stack(
                            [
                                reference(input_ids=torch.tensor([list(r.ids)], device=ck.device))
                                .last_hidden_state[0]
                                .mean(0)
                                .float()
                                .cpu()
                                .numpy()
                                for r in requests
                            ]
                        )
                cos = min_cosine(eng.embed(texts), want)
                bound = 0.9999 if dtype == "float32" else 0.99
                ck.add(
                    section="decoder",
                    kernel="embed",
                    provider=f"engine_{backend}",
                    config=config,
                    dtype=dtype,
                    metric="min_cosine_vs_transformers",
                    value=cos,
                    bound=bound,
                    ok=bool(cos >= bound),
                )
                ck.add(
                    section="decoder",
                    kernel="embed",
                    provider=f"engine_{backend}",
                    config=config,
                    dtype=dtype,
                    metric="longest_tokens",
                    value=float(max(r.length for r in requests)),
                )
