"""lab.eval.bench on tiny workloads: table rows and columns, token and padding counts, knob restoration. No speed
claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_models import tiny_llama

from lab import Engine
from lab.eval.bench import (
    SentenceTransformerBaseline,
    chunked_prefill,
    peak_memory,
    texts_of_length,
    throughput,
    throughput_by_length,
)

TEXTS = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Hi.",
    "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
    "A woman is slicing an onion.",
    "Two dogs run through a field.",
]
BASE_COLUMNS = {
    "system",
    "texts",
    "tokens",
    "padded_tokens",
    "tokens_computed",
    "seconds_median",
    "seconds_min",
    "seconds_max",
    "tokens_per_s",
    "threads",
    "torch",
    "machine",
}


@pytest.fixture()
def minilm(minilm_path):
    return Engine(minilm_path)


def test_throughput_engine_sweep_and_st_baseline(minilm, minilm_st):
    base = SentenceTransformerBaseline(minilm_st, batch_size=4)
    before = dict(minilm.knobs)
    df = throughput(
        {"engine": minilm, "sentence-transformers": base},
        TEXTS,
        sweep={"max_batch_tokens": [16, 4096], "pooling": ["mean", "cls"]},
        repeats=2,
        warmup=0,
    )
    assert minilm.knobs == before  # the sweep is undone
    assert len(df) == 4 + 1  # 2 x 2 engine settings + one baseline row
    assert BASE_COLUMNS | {"max_batch_tokens", "pooling"} <= set(df.columns)
    eng, st = df[df.system == "engine"], df[df.system == "sentence-transformers"]
    assert sorted(map(tuple, eng[["max_batch_tokens", "pooling"]].values.tolist())) == [
        (16, "cls"),
        (16, "mean"),
        (4096, "cls"),
        (4096, "mean"),
    ]
    assert st["max_batch_tokens"].isna().all() and st["pooling"].isna().all()
    # the same real tokens for both systems; the engine pads nothing, sentence-transformers pads its batches
    assert (eng["tokens"] == st["tokens"].iloc[0]).all()
    assert (eng["padded_tokens"] == 0).all() and st["padded_tokens"].iloc[0] > 0
    assert (df["texts"] == len(TEXTS)).all()
    assert (df["seconds_min"] <= df["seconds_median"]).all() and (df["seconds_median"] <= df["seconds_max"]).all()
    np.testing.assert_allclose(df["tokens_per_s"], df["tokens"] / df["seconds_median"])


def test_st_baseline_token_counts(minilm_st):
    base = SentenceTransformerBaseline(minilm_st, batch_size=2)
    real, pad = base.token_counts(["a b c d e f", "a", "a b", "a b c"])
    lengths = sorted(
        (len(x) for x in minilm_st.tokenizer(["a b c d e f", "a", "a b", "a b c"])["input_ids"]), reverse=True
    )  # [8, 5, 4, 3]: batches (8, 5) and (4, 3)
    assert real == sum(lengths) and pad == (8 - 5) + (4 - 3)
    assert base(["a", "b"]).shape == (2, 384)


def test_throughput_plain_callable_and_list_of_systems(minilm):
    calls = []

    def fake(texts):
        calls.append(len(texts))
        return np.zeros((len(texts), 4))

    fake.name = "fake"
    df = throughput([minilm, fake], TEXTS[:2], repeats=1, warmup=1)
    assert list(df.system) == [minilm.model_name, "fake"]
    assert calls == [2, 2]  # warm-up + one timed run
    assert df.loc[1, "tokens"] == df.loc[0, "tokens"] and pd.isna(df.loc[1, "padded_tokens"])
    with pytest.raises(ValueError, match="repeats"):
        throughput([fake], TEXTS, repeats=0)


def test_texts_of_length_and_throughput_by_length(minilm):
    tok = minilm.tokenizer
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS)
    long = texts_of_length(tok, TEXTS, 40, count=3)
    assert len(long) == 3 and len(set(long)) == 3
    for t in long:
        n = len(tok(t, add_special_tokens=False)["input_ids"])
        assert abs(n - 40) <= longest // 2 + 1  # whole sentences: within half a sentence of the target
    short = texts_of_length(tok, TEXTS, 1, count=2)
    assert short == TEXTS[:2]  # never fewer than one sentence
    df = throughput_by_length({"engine": minilm}, {8: short, 40: long}, repeats=1, warmup=0)
    assert list(df.bucket) == [8, 40]
    np.testing.assert_allclose(df["length"], df["tokens"] / df["texts"])
    assert df["length"].iloc[0] < df["length"].iloc[1]


def test_peak_memory_sees_tensor_allocations():
    """The peak is the most tensor memory alive at once: both tensors alive together count (not only the larger),
    and one allocated after they were freed does not add to them (frees are seen). What else a machine's torch
    allocates during the call (rounding, the profiler's own small buffers) differs between machines, so the bound
    is a relation with 3 MiB of slack, while each wrong answer is 4 MiB (8: the larger alone) or 8 MiB (20: frees
    missed) away."""
    MiB = 2**20

    def work():
        a = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB
        b = torch.empty(2 << 20, dtype=torch.float32)  # 8 MiB, both alive: the peak, 12 MiB
        del a, b
        return torch.empty(2 << 20).numel()  # 8 MiB after the peak: 20 MiB if frees were missed

    result, peak = peak_memory(work)
    assert result == 2 << 20
    both = 12 * MiB
    assert both <= peak < 1.25 * both, peak / MiB  # at least both tensors; below 15 MiB, far below 20


def test_chunked_prefill_rows_and_equality(tmp_path):
    eng = Engine(str(tiny_llama(tmp_path, "llama")))
    texts = ["The quick brown fox jumps over the lazy dog. " * 4, "Rotary position embeddings rotate queries."]
    df = chunked_prefill(eng, texts, [8, 32], repeats=1)
    assert eng.knobs["chunked_prefill"] is None
    assert len(df) == 2 * 3
    assert {
        "text",
        "input_tokens",
        "chunked_prefill",
        "chunks",
        "seconds",
        "peak_mb",
        "state_mb",
        "max_abs_diff",
        "cosine",
    } <= set(df.columns)
    assert df["chunked_prefill"].isna().sum() == 2  # the unchunked reference, once per text
    assert (df["max_abs_diff"] < 1e-4).all() and (df["cosine"] > 0.9999).all()
    assert (df["peak_mb"] > 0).all()
    first = df[df.text == 0]
    assert first["input_tokens"].nunique() == 1
    chunks = dict(zip(first["chunked_prefill"].fillna(0), first["chunks"]))
    assert chunks[8] > chunks[32]  # smaller chunks, more pieces
    # held across steps: the input's hidden states + one layer's K and V (float32); nothing on the unchunked path
    cfg = eng.spec.config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = (cfg["hidden_size"] + 2 * cfg["num_key_value_heads"] * head_dim) * 4
    state = dict(zip(first["chunked_prefill"].fillna(0), first["state_mb"] * 2**20))
    assert state[0] == 0 and state[8] == first["input_tokens"].iloc[0] * per_token

    eng.configure(bidirectional=True)
    with pytest.raises(ValueError, match="causal"):
        chunked_prefill(eng, texts, [8])


def _bench_decoder(module: str = "bench_decoder"):
    """evals/bench_decoder.py (or ``module``, one of its parts) as a module. The script puts the repository root on
    the path; keep `kernels` off it here."""
    import sys

    from lab._repo import import_evals

    saved = list(sys.path)
    try:
        return import_evals(module)
    finally:
        sys.path[:] = saved


@pytest.mark.filterwarnings("ignore:.*were truncated")  # the long text, cut at 64 tokens alike on both sides
def test_decoder_benchmark_baseline_keeps_float32_weights_and_matches_engine(tmp_path):
    """evals/bench_decoder.py's padded transformers baseline: float32 after a bfloat16 run gives the first float32
    rows bit for bit (bfloat16 runs a cast copy, the loaded weights are never rounded), and it agrees with the
    Engine under mean and lasttoken pooling on uneven lengths (its batches of 3 pad)."""
    throughput = _bench_decoder("decoder_throughput")
    path = tiny_llama(tmp_path, "llama")
    base = throughput.PaddedTransformersEmbedder(str(path), batch_size=3, max_length=64)
    before = base(TEXTS)
    low = base.configure(dtype="bfloat16")(TEXTS)
    after = base.configure(dtype="float32")(TEXTS)
    np.testing.assert_array_equal(before, after)
    assert not np.array_equal(before, low)
    eng = Engine(str(path), max_length=64)
    for pooling in ("mean", "lasttoken"):
        eng.configure(pooling=pooling)
        base.configure(pooling=pooling, append_eos=eng.resolved.append_eos)
        assert [list(r.ids) for r in eng.tokenize(TEXTS)] == base.tokenize(TEXTS)
        assert throughput.min_cosine(eng.embed(TEXTS), base(TEXTS)) >= 0.9999


@pytest.mark.filterwarnings("ignore:.*were truncated")
def test_decoder_benchmark_self_check_rows(tmp_path):
    """bench_decoder's ``--self-check``: the baseline against itself at another batch size, one row per dtype and
    pooling, against the cosine target; float32 agrees with itself (other padding, same function), and without the
    flag there is no such row."""
    bench_decoder, sections = _bench_decoder(), _bench_decoder("decoder_sections")
    throughput = _bench_decoder("decoder_throughput")
    path = str(tiny_llama(tmp_path, "llama"))
    argv = [
        "--model",
        path,
        "--sections",
        "throughput",
        "--docs",
        "7",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--dtypes",
        "float32",
        "bfloat16",
        "--poolings",
        "lasttoken",
        "--batch-sizes",
        "3",
        "--max-length",
        "64",
    ]
    for flag in (True, False):
        table = sections.Table("test", "cpu")
        args = bench_decoder.parse_args(argv + ["--out", str(tmp_path / "b.csv")] + (["--self-check"] if flag else []))
        throughput.bench_throughput(args, path, table)
        df = table.frame()
        rows = df[df.metric == "min_cosine_vs_itself_other_batch"].set_index("dtype")
        if not flag:
            assert rows.empty
            continue
        assert sorted(rows.index) == ["bfloat16", "float32"]
        assert set(rows.setting) == {f"batch_size=3 vs {throughput.SELF_CHECK_BATCH}"}
        assert rows.loc["float32", "value"] >= 0.99999 and rows.loc["float32", "meets_target"]
        assert 0.9 < rows.loc["bfloat16", "value"] <= 1.0 + 1e-6
        # the same figure computed here, from the bench's texts and the baseline's two batchings
        texts = sections.throughput_texts("mixed", 7)
        base = throughput.PaddedTransformersEmbedder(
            path,
            batch_size=3,
            max_length=64,
            dtype="bfloat16",
            pooling="lasttoken",
            append_eos=Engine(path, max_length=64).resolved.append_eos,
        )
        want = throughput.min_cosine(base(texts), base.configure(batch_size=throughput.SELF_CHECK_BATCH)(texts))
        assert rows.loc["bfloat16", "value"] == pytest.approx(want, abs=1e-7)
        assert (rows.target == 0.9999).all() and (rows.system == "padded-transformers").all()


def test_embed_benchmark_targets_need_ratio_and_cosine():
    """evals/bench_embed.py marks issue 15's targets on the engine's rows only: the mixed-corpus ratio counts as met
    only at min cosine >= 0.9999, the float32 roofline share on STSBenchmark and SciFact."""
    from lab._repo import import_evals

    targets = import_evals("bench_embed").targets
    df = pd.DataFrame(
        {
            "corpus": ["mixed", "mixed", "mixed", "scifact", "scifact"],
            "dtype": ["float32", "bfloat16", "bfloat16", "float32", "float32"],
            "system": ["engine", "engine", "sentence-transformers", "engine", "sentence-transformers"],
            "ratio_vs_sentence_transformers": [1.5, 3.9, 1.0, 1.1, 1.0],
            "min_cosine": [0.99999, 0.99980, 0.99980, 1.0, 1.0],
            "roofline_fraction": [0.9, 0.7, 0.2, 0.84, 0.7],
        }
    )
    out = targets(df)
    assert list(out.meets_ratio_target) == [True, False, None, None, None]  # bfloat16: fast enough, cosine too low
    assert list(out.meets_roofline_target) == [None, None, None, False, None]
    assert out.ratio_target.tolist()[:2] == [1.45, 1.6] and "ratio_target" not in df  # the input is left alone


def test_attention_seconds_times_each_length_once_and_scales_by_count(monkeypatch):
    """lab.eval.bench.attention_seconds times one packed run per distinct length (at most ``run_cap`` sequences, laid
    out as the engine packs them), keeps the best timing and scales it to that length's count; threads are restored;
    with ``kernel`` it times the three-op path or prefill-lab's own kernel."""
    from lab.kernels import cpu_attention

    from lab.eval import bench
    from lab.ops import attention
    from lab.ops.attention import MATMUL_SCORES

    calls = []

    def fake_attention(q, k, v, cu, max_seqlen, *, causal, seqlens, matmul_scores=None):
        calls.append((tuple(q.shape), cu.tolist(), max_seqlen, causal, list(seqlens), matmul_scores))
        return q

    # the torch kernels as ``lab.ops.attention.attention`` dispatches to them (what a layer calls)
    monkeypatch.setattr(attention._TORCH_OPS, "varlen_attention", fake_attention)
    monkeypatch.setattr(bench, "_time", lambda fn, repeats: [fn(), 0.5, 0.2][1:])  # best of these: 0.2 s
    threads = torch.get_num_threads()
    lengths = [7, 1, 7, 30, 7, 7, 7]  # shuffled; run_cap 3 -> the five 7-token sequences run as 3
    got = bench.attention_seconds(lengths, heads=2, head_dim=4, threads=1, run_cap=3, repeats=2)
    assert torch.get_num_threads() == threads
    assert got == pytest.approx(0.2 * 1 + 0.2 * 5 / 3 + 0.2 * 1)
    # per length: one untimed call, then the timed ones (here one, via the fake _time)
    assert [c[2] for c in calls] == [1, 1, 7, 7, 30, 30]
    assert calls[2] == ((21, 2, 4), [0, 7, 14, 21], 7, False, [7, 7, 7], None)
    calls.clear()  # the engine's three-op path (``attention_kernel`` = ``matmul``) when asked
    bench.attention_seconds([5], heads=2, head_dim=4, threads=1, kernel="matmul")
    assert calls and all(c[5] == MATMUL_SCORES for c in calls)
    calls.clear()  # and prefill-lab's own kernel (``lab``)
    own = []
    monkeypatch.setattr(cpu_attention, "varlen_attention", lambda q, k, v, cu, causal: own.append((q.shape, causal)))
    monkeypatch.setattr(cpu_attention, "available", lambda: True)  # the fake runs even where the C kernel cannot
    bench.attention_seconds([5, 5, 3], heads=2, head_dim=16, threads=1, kernel="lab")
    assert not calls and own == [((3, 2, 16), False)] * 2 + [((10, 2, 16), False)] * 2
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        bench.attention_seconds([5], heads=2, head_dim=16, kernel="fast")
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        bench.attention_seconds([3, 0], heads=2, head_dim=4)


def test_embed_benchmark_kernel_seconds_real_kernel(minilm):
    """evals/bench_embed.py's ``kernel_seconds`` on a real engine: GEMM time from the roofline it is given, attention
    timed at the texts' token lengths, and the roofline share an engine doing only these two would reach."""
    from lab._repo import import_evals

    kernel_seconds = import_evals("bench_embed").kernel_seconds
    tokens = sum(r.length for r in minilm.tokenize(TEXTS))
    out = kernel_seconds(minilm, TEXTS, {"roofline_tokens_per_s": tokens / 2.0})  # GEMMs: 2 s by construction
    assert out["gemm_seconds_at_roofline"] == pytest.approx(2.0)
    assert 0 < out["attention_seconds"] < 1.0  # six short texts, six layers
    assert out["kernel_seconds"] == pytest.approx(2.0 + out["attention_seconds"])
    assert out["roofline_cap"] == pytest.approx(2.0 / out["kernel_seconds"]) and out["roofline_cap"] < 1


def test_decoder_benchmark_profile_sees_the_cpu_workers(tmp_path):
    """bench_decoder's ``--profile`` rows: the engine's GEMMs and attention run in its CPU worker threads, and the
    profile must count them (a profiler started in the main thread alone saw ~0 s of GEMMs there)."""
    throughput = _bench_decoder("decoder_throughput")
    path = str(tiny_llama(tmp_path, "llama"))
    eng = Engine(path, cpu_workers=2)
    texts = [" ".join(["word"] * n) for n in (9, 30, 17, 4, 25, 12)]
    eng.embed(texts)
    groups, table = throughput.profile_call(lambda: eng.embed(texts), "cpu")
    assert groups["gemm"] > 0 and groups["attention"] > 0, groups
    assert "scaled_dot_product" in table


def test_attention_benchmark_times_every_kernel_at_both_models_shapes(tmp_path):
    """evals/bench_attention.py: one row per model, dtype, length and kernel offered (``matmul`` for the encoder
    only, ``lab`` where it built), times relative to ``sdpa`` in the same round, the CPU recorded; the CSV (with its
    ``run_date``), the plot and the sidecar written under this machine's name."""
    from lab.kernels import cpu_attention

    from lab._repo import import_evals

    bench_attention = import_evals("bench_attention")
    df = bench_attention.run([5, 16], ["float32", "bfloat16"], tokens=40, rounds=2)
    own = ["lab"] if cpu_attention.available() else []
    for model, kernels in (("all-MiniLM-L6-v2", ["sdpa", "matmul", *own]), ("SmolLM2-135M", ["sdpa", *own])):
        g = df[df.model == model]
        assert len(g) == 4 * len(kernels) and set(g.kernel) == set(kernels)
    assert (df[df.kernel == "sdpa"].time_vs_sdpa == 1).all() and (df.gflops > 0).all()
    assert df.sequences.tolist()[0] == 8 and df.cpu_model.notna().all()
    bench_attention.main(
        ["--lengths", "7", "--dtypes", "float32", "--tokens", "14", "--rounds", "1", "--out", str(tmp_path)]
    )
    from lab.ops.probes import machine_slug

    stem = tmp_path / f"bench_attention_{machine_slug()}"
    assert stem.with_suffix(".png").exists() and Path(f"{stem}.csv.meta.json").exists()
    assert pd.read_csv(stem.with_suffix(".csv")).run_date.notna().all()
