"""The whole engine with attention_backend="triton" equals the torch path (Triton interpreter on CPU, tiny models).

Triton fixes interpreter mode when it is first imported (see tests/kernel_utils.py), so the engines run in a fresh
process started with TRITON_INTERPRET=1; it prints one line per model with the minimum per-text cosine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.interpreter
TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import sys, tempfile
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import numpy as np
    from conftest import cosine_rows
    from tiny_encoders import tiny_encoder
    from tiny_models import tiny_llama
    from lab import Engine

    texts = ["a", "hello world", "", "the quick brown fox jumps over the lazy dog", "naive cafe"]
    tmp = Path(tempfile.mkdtemp())
    llama = tiny_llama(tmp / "llama", "llama")
    cases = [
        ("bert", tiny_encoder(tmp / "bert", {minilm!r}, "bert", hidden=32, layers=1, heads=2), {{}}),
        ("llama-causal", llama, {{"pooling": "mean"}}),
        ("llama-bidirectional", llama, {{"pooling": "weightedmean", "bidirectional": True}}),
        ("llama-chunked", llama, {{"pooling": "lasttoken", "chunked_prefill": 3}}),
        ("llama-lasttoken", llama, {{"pooling": "lasttoken"}}),  # last layer for the pooled rows only
        ("llama-cls-bidirectional", llama, {{"pooling": "cls", "bidirectional": True}}),
    ]
    for name, path, knobs in cases:
        ref = Engine(str(path), attention_backend="torch", **knobs).embed(texts)
        eng = Engine(str(path), attention_backend="triton", **knobs)
        got = eng.embed(texts)
        assert eng.stats.backend == "triton", eng.stats.backend
        print(name, float(cosine_rows(got, ref).min()))
    """
)


def test_engine_triton_backend_equals_torch(minilm_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = SCRIPT.format(tests=str(TESTS), minilm=minilm_path)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = dict(line.split() for line in proc.stdout.strip().splitlines())
    assert set(results) == {
        "bert",
        "llama-causal",
        "llama-bidirectional",
        "llama-chunked",
        "llama-lasttoken",
        "llama-cls-bidirectional",
    }
    for name, cos in results.items():
        assert float(cos) >= 0.9999, (name, cos)
