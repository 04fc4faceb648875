"""Bad input is refused at the door (load, ``configure``, the call) with an error that names it, before any model
work, and an interrupt leaves the engine whole (issue 16, first part)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lab import Engine


@pytest.fixture(scope="module")
def eng(minilm_path):
    return Engine(minilm_path)


@pytest.mark.parametrize(
    "texts, error, match",
    [
        (b"raw bytes", TypeError, r"got bytes; decode it first"),
        ({"a": "first text", "b": "second"}, TypeError, r"got a dict .*keys.*list\(d.values\(\)\)"),
        ({"one", "two"}, TypeError, r"got a set, which has no order"),
        (frozenset({"one"}), TypeError, r"got a frozenset"),
        (["ok", b"bytes item"], TypeError, r"texts\[1\] is bytes, not str.*decode"),
        (["ok", "fine", "bad \ud800 surrogate"], ValueError, r"texts\[2\] cannot be encoded as UTF-8"),
        ([1.5], TypeError, r"texts\[0\] is float"),
    ],
)
def test_bad_containers_and_items_are_named(eng, texts, error, match):
    before = eng.stats
    with pytest.raises(error, match=match):
        eng.embed(texts)
    assert eng.stats is before  # nothing ran


def test_dataframe_is_refused_with_the_fix(eng):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"text": ["a man plays", "a woman sings"]})
    with pytest.raises(TypeError, match=r"DataFrame .*column names.*df\[column\].tolist\(\)"):
        eng.embed(df)
    assert eng.embed(df["text"]).shape == (2, 384)  # a Series is its values, in order


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"truncate_dim": 10**6}, r"truncate_dim=1000000 exceeds the embedding size 384; valid: 1..384"),
        ({"max_length": 600}, r"max_length=600 but this model has 512 positions; valid: 1..512"),
        ({"max_length": 2}, r"max_length=2 leaves no room for text.*2 special token.*>= 3"),
        ({"pooling": "foo"}, r"unknown pooling 'foo'"),
    ],
)
def test_knobs_are_checked_at_configure_and_change_nothing(eng, knobs, match):
    before = (eng.knobs, eng.resolved)
    with pytest.raises(ValueError, match=match):
        eng.configure(**knobs)
    with pytest.raises(ValueError, match=match):
        eng.validate(**knobs)
    assert (eng.knobs, eng.resolved) == before


def test_max_length_at_the_limit_runs(minilm_path):
    e = Engine(minilm_path, max_length=3)
    assert e.embed(["a long sentence that is cut"]).shape == (1, 384) and e.stats.tokens == 3


def test_decoder_past_its_positions_warns(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_llama

    folder = tiny_llama(tmp_path, "llama", max_position_embeddings=64)
    with pytest.warns(UserWarning, match=r"max_length=100 is past this decoder's max_position_embeddings=64"):
        Engine(str(folder), max_length=100)


@pytest.mark.parametrize(
    "a, b, match",
    [
        (np.ones(4), None, r"a must be a 2-D array \(n, dim\), got shape \(4,\); for one vector pass a\[None\]"),
        (np.ones((2, 3, 4)), None, r"got shape \(2, 3, 4\)"),
        (np.ones((2, 4)), np.ones((3, 5)), r"a has 4 dimensions and b has 5"),
    ],
)
def test_similarity_checks_its_shapes(eng, a, b, match):
    with pytest.raises(ValueError, match=match):
        eng.similarity(a, b)


def test_similarity_argument_only_for_bi_encoders(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_llama

    e = Engine(str(tiny_llama(tmp_path, "llama")))
    with pytest.raises(ValueError, match=r"similarity='dot' is for mode='bi-encoder'; this call scores in mode='llm'"):
        e.score([("q", "d")], mode="llm", similarity="dot")


def test_sweep_values_are_checked_before_any_variant_runs(eng):
    from lab import evaluate

    before = eng.stats
    with pytest.raises(ValueError, match=r"sweep variant pooling=foo: unknown pooling 'foo'"):
        evaluate(eng, ["STSBenchmark"], sweep={"pooling": ["mean", "foo"]}, cache=None, show_progress=False)
    assert eng.stats is before and eng.knobs["pooling"] is None


def test_custom_code_in_a_model_folder_is_never_run(tmp_path, minilm_path):
    """A folder whose config.json points at its own Python (``auto_map``) is refused before transformers sees it;
    the folder's code would leave a marker file if it ran."""
    folder = tmp_path / "custom"
    shutil.copytree(minilm_path, folder)
    marker = tmp_path / "code_ran"
    (folder / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(
        architectures=["CustomModel"],
        model_type="custom-lab-test",
        auto_map={"AutoConfig": "modeling_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"},
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"declares custom model code .*never executes code from a model folder"):
        Engine(str(folder))
    assert not marker.exists()


def _interrupt_in(path_suffix: str, nth: int, fn) -> bool:
    """Run ``fn`` with a KeyboardInterrupt raised at the ``nth`` line executed in a file ending ``path_suffix``;
    True if it was raised (``fn`` had at least ``nth`` such lines)."""
    count = [0]

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name.endswith(path_suffix) or (path_suffix.startswith("/") and path_suffix in name):
            if event == "line":
                count[0] += 1
                if count[0] == nth:
                    raise KeyboardInterrupt
            return tracer
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_interrupted_dtype_switch_is_repaired(minilm_path):
    """Ctrl-C at every line of the runner's weight switch: the next ``configure(dtype=...)`` leaves every weight in
    that dtype and the embeddings exact (it used to leave mixed float32 / bfloat16 weights that stayed mixed)."""
    e = Engine(minilm_path, cpu_workers=1)
    texts = ["a man plays a guitar", "someone is cooking"]
    base = e.embed(texts)
    hit = 0
    for nth in range(1, 200):
        if not _interrupt_in("lab/runtime/weights.py", nth, lambda: e.configure(dtype="bfloat16")):
            break
        hit += 1
        e.configure(dtype="float32")
        assert all(p.dtype == torch.float32 for p in e.model.parameters()), nth
        np.testing.assert_array_equal(e.embed(texts), base)
    assert hit > 5  # the trace reached the switch's lines


def _copy_with(minilm_path, folder: Path, *, drop: str | None = None, config: dict | None = None) -> Path:
    """A copy of all-MiniLM-L6-v2's transformers files with one tensor dropped or config values changed."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if Path(minilm_path, f).exists():
            shutil.copy(Path(minilm_path, f), folder / f)
    sd = load_file(str(Path(minilm_path, "model.safetensors")))
    if drop:
        sd = {k: v for k, v in sd.items() if not k.endswith(drop)}
    save_file(sd, str(folder / "model.safetensors"))
    cfg = json.loads(Path(minilm_path, "config.json").read_text())
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_missing_weights_are_an_error_not_zeros(tmp_path, minilm_path):
    """A BERT checkpoint without token_type_embeddings used to load with zeros (cosine 0.62-0.90 to the real model);
    transformers reports it MISSING."""
    folder = _copy_with(minilm_path, tmp_path / "m", drop="token_type_embeddings.weight")
    with pytest.raises(KeyError, match=r"token_type_embeddings.weight' missing .*type_vocab_size=2"):
        Engine(str(folder))


def test_unused_weights_are_reported(tmp_path, minilm_path):
    """A config with 3 layers over 6 layers' weights used to run 3 layers silently; now it says which tensors it
    leaves unread, as transformers' UNEXPECTED report does."""
    folder = _copy_with(minilm_path, tmp_path / "m", config={"num_hidden_layers": 3})
    with pytest.warns(
        UserWarning, match=r"weight\(s\) this config.json does not use: encoder.layer.3.*num_hidden_layers"
    ):
        Engine(str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the real folder: every tensor is read (the pooler is documented unused)
        Engine(minilm_path)


@pytest.mark.parametrize(
    "index, match",
    [
        (
            {"weight_map": {"a": "../outside.safetensors"}},
            r"names the shard '../outside.safetensors', which is not a file inside",
        ),
        ({"weights": {}}, r"is not a valid shard index .*KeyError"),
        ("not json {", r"is not a valid shard index"),
    ],
)
def test_shard_index_is_checked(tmp_path, minilm_path, index, match):
    folder = _copy_with(minilm_path, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ValueError, match=match):
        Engine(str(folder))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda f: (f / "config.json").write_text("{not json"), r"config.json is not valid JSON"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), r"config.json should hold a JSON object .*got a list"),
        (lambda f: (f / "modules.json").write_text('{"a": 1}'), r"modules.json should hold a JSON list"),
        (
            lambda f: _edit_config(f, num_attention_heads=5),
            r"hidden_size=384 is not divisible by num_attention_heads=5",
        ),
        (lambda f: _edit_config(f, hidden_size=None), r"config.json lacks 'hidden_size'"),
        (
            lambda f: (f / "model.gguf").write_bytes(b"") or (f / "config.json").unlink(),
            r"model.gguf is not a GGUF file .*it is empty",
        ),
    ],
)
def test_broken_folders_get_errors_that_name_the_file(tmp_path, minilm_path, change, match):
    folder = _copy_with(minilm_path, tmp_path / "m")
    (folder / "modules.json").write_text("[]")
    change(folder)
    with pytest.raises(ValueError, match=match):
        Engine(str(folder))


def _edit_config(folder: Path, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_interrupts_anywhere_in_embed_leave_the_engine_exact(minilm_path):
    """KeyboardInterrupt raised at 40 points spread over every line ``embed`` executes in ``lab/`` (tokenization,
    scheduling, the executor, the model, pooling, the output buffer): the next call gives exactly the rows of an
    undisturbed engine, and an interrupted call never publishes stats of its own."""
    e = Engine(minilm_path, max_batch_tokens=24)  # several packed steps per call
    texts = ["a man plays a guitar", "someone is cooking dinner tonight", "short", "", "the cat sat on the mat"]
    base = e.embed(texts)
    total = _count_lines("/lab/", lambda: e.embed(texts))
    assert total > 200
    for nth in np.linspace(1, total - 1, 40).astype(int):
        done = e.stats
        assert _interrupt_in("/lab/", int(nth), lambda: e.embed(texts))
        assert e.stats is done or e.stats.sequences == len(texts)  # the old stats, or the finished call's
        np.testing.assert_array_equal(e.embed(texts), base)


def test_an_interrupt_at_any_line_of_the_gate_never_hangs_the_next_call(minilm_path):
    """KeyboardInterrupt at every line ``embed`` executes in ``lab/engine/gate.py`` (the with-exit line events
    included, where the lock is taken but not yet given back): the same thread's next call runs, exactly. The
    calls run in a worker thread so that a hang fails here instead of stalling the suite. (An interrupt inside the
    bookkeeping of a call's exit can leave the thread counted as inside a call, which its later calls then run as
    nested ones, with fewer gate lines: those points may find no line to interrupt.)"""
    e = Engine(minilm_path)
    texts = ["a man plays a guitar", "short", ""]
    base = e.embed(texts)
    failures, done = [], []

    def every_line():
        lines = _count_lines("/lab/engine/gate.py", lambda: e.embed(texts))
        assert lines >= 10
        for nth in range(1, lines + 1):
            _interrupt_in("/lab/engine/gate.py", nth, lambda: e.embed(texts))
            if not np.array_equal(e.embed(texts), base):
                failures.append((nth, "rows differ"))
        done.append(True)

    worker = threading.Thread(target=every_line, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "a call after an interrupt in the gate hung"
    assert done and failures == []


def _count_lines(fragment: str, fn) -> int:
    count = [0]

    def tracer(frame, event, arg):
        if fragment in frame.f_code.co_filename and event == "line":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0]


@pytest.mark.parametrize(
    "knob, value, error, match",
    [
        ("normalize", "yes", TypeError, r"normalize must be True, False or None"),
        ("bidirectional", 1, TypeError, r"bidirectional must be True, False or None"),
        ("append_eos", "no", TypeError, r"append_eos must be True, False or None"),
        ("include_instruction", "x", TypeError, r"include_instruction must be True, False or None"),
        ("prefix_cache", None, TypeError, r"prefix_cache must be True or False"),
        ("max_length", 0, ValueError, r"max_length must be a positive int"),
        ("max_num_seqs", -1, ValueError, r"max_num_seqs must be a positive int"),
        ("chunked_prefill", 0, ValueError, r"chunked_prefill must be a positive int"),
        ("truncate_dim", True, ValueError, r"truncate_dim must be a positive int"),
        ("instruction", 3, TypeError, r"instruction must be a string or None"),
        ("layer", 1.5, TypeError, r"layer must be an int"),
        ("layer", 99, ValueError, r"layer=99 but this model has 6 layers"),
        ("chunked_prefill", 8, ValueError, r"chunked_prefill needs causal attention"),
        ("dtype", "int8", ValueError, r"unknown dtype 'int8'"),
    ],
)
def test_every_knob_refuses_bad_values_and_changes_nothing(eng, knob, value, error, match):
    before = (eng.knobs, eng.resolved)
    with pytest.raises(error, match=match):
        eng.configure(**{knob: value})
    assert (eng.knobs, eng.resolved) == before


def test_bad_pairs_are_named_before_any_work(eng):
    before = eng.stats
    with pytest.raises(ValueError, match=r"pairs\[1\]'s document cannot be encoded as UTF-8"):
        eng.score([("q", "d"), ("q", "bad \udcff")])
    with pytest.raises(TypeError, match=r"pairs\[0\]'s query is bytes"):
        eng.score([(b"q", "d")])
    assert eng.stats is before


def test_interrupted_configure_leaves_the_old_state_or_the_new(minilm_path):
    """Ctrl-C at 30 points of ``configure(dtype=..., pooling=...)`` (all of ``lab/``): afterwards the engine either
    still answers as before or as the new knobs say, and a second configure makes it exact again."""
    e = Engine(minilm_path, cpu_workers=1)
    texts = ["a man plays a guitar", "someone is cooking"]
    base = e.embed(texts)
    cls = Engine(minilm_path, cpu_workers=1, pooling="cls", dtype="bfloat16").embed(texts)
    total = _count_lines("/lab/", lambda: e.configure(dtype="bfloat16", pooling="cls"))
    e.configure(dtype="float32", pooling=None)
    for nth in np.linspace(1, total - 1, 30).astype(int):
        assert _interrupt_in("/lab/", int(nth), lambda: e.configure(dtype="bfloat16", pooling="cls"))
        got = e.embed(texts)
        assert np.array_equal(got, base) or np.array_equal(got, cls), nth
        e.configure(dtype="float32", pooling=None)
        assert all(p.dtype == torch.float32 for p in e.model.parameters())
        np.testing.assert_array_equal(e.embed(texts), base)


@pytest.mark.parametrize(
    "template",
    ["Rewrite the sentence: {text}, rewritten sentence: {text}", 'This sentence : "{text}" means in one word:"'],
)
def test_a_template_pools_the_text_not_its_words_on_a_sentence_transformers_folder(minilm_path, template):
    """all-MiniLM-L6-v2's Pooling config pools a prompt (include_prompt); a template's words are no prompt: by
    default only the tokens of the text's last copy are pooled, as ``include_instruction=False`` pools them."""
    texts = ["A man is playing a guitar.", "a", "Two dogs run through a field of tall green grass."]
    eng = Engine(minilm_path, template=template)
    assert eng.resolved["include_instruction"] is False
    assert eng.resolved.sources["include_instruction"].startswith("template")
    np.testing.assert_array_equal(
        eng.embed(texts), Engine(minilm_path, template=template, include_instruction=False).embed(texts)
    )
    pooled_all = Engine(minilm_path, template=template, include_instruction=True).embed(texts)
    assert not np.allclose(eng.embed(texts), pooled_all, atol=1e-3)  # the knob still pools everything when set


def test_knob_values_built_with_numpy_are_taken(eng, minilm_path):
    """Sweeps built with np.arange or pandas columns hand numpy scalars; they count as the Python values they hold,
    and a numpy bool stays refused where an int is asked."""
    texts = ["A man is playing a guitar.", "Someone plays guitar."]
    got = Engine(minilm_path, max_length=np.int64(8), truncate_dim=np.int32(64)).embed(texts)
    np.testing.assert_array_equal(got, Engine(minilm_path, max_length=8, truncate_dim=64).embed(texts))
    e = Engine(minilm_path)
    e.configure(max_batch_tokens=np.int64(64), normalize=np.bool_(True), layer=np.int16(3))
    assert (e.knobs["max_batch_tokens"], e.knobs["normalize"], e.knobs["layer"]) == (64, True, 3)
    assert type(e.knobs["max_batch_tokens"]) is int
    with pytest.raises(ValueError, match="max_length must be a positive int or None, got True"):
        e.configure(max_length=np.bool_(True))
    assert e.encode(texts, truncate_dim=np.int64(32), batch_size=np.int64(8)).shape == (2, 32)
    assert e.embed_chunks([" ".join(texts)], np.int64(4))[0].shape[1] == 384
