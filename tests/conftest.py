"""Shared fixtures: offline hub, a seeded RNG per test, the bundled all-MiniLM-L6-v2 and its references."""

from __future__ import annotations

import faulthandler
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch

TEST_SECONDS = 900  # a test still running after this has hung: every thread's stack is printed and the run ends
_STDERR = []  # the terminal's stderr, duplicated before pytest captures the tests' output


def pytest_configure(config):
    _STDERR.append(os.fdopen(os.dup(sys.stderr.fileno()), "w"))


def pytest_unconfigure(config):
    while _STDERR:
        _STDERR.pop().close()


@pytest.fixture(autouse=True)
def _watchdog():
    """End the run with every thread's stack when a test hangs, instead of waiting for CI's hard limit."""
    faulthandler.dump_traceback_later(TEST_SECONDS, exit=True, file=_STDERR[0])
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def c_builds(tmp_path_factory):
    """prefill-lab's C kernels (the library ``lab.kernels.cpu_attention`` builds) as this machine loads them
    (``None``: the default library) and as a machine without AVX-512 (``avx2``, where this CPU has AVX2) or without any
    x86 flags (``portable``) would build them."""
    from lab.kernels import cpu_attention

    from lab.ops.probes import cpu_info

    d = tmp_path_factory.mktemp("kernels")
    out = {"native": None, "portable": cpu_attention.bind(cpu_attention.build(arch=[], directory=d))}
    if "avx2" in cpu_info()["cpu_flags"].split():
        out["avx2"] = cpu_attention.bind(cpu_attention.build(arch=["-mavx2", "-mfma"], directory=d))
    return out


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from lab._extras import minilm_path

    return minilm_path()


@pytest.fixture(scope="session")
def minilm_engine(minilm_path):
    from lab import Engine

    return Engine(minilm_path)


@pytest.fixture(scope="session")
def minilm_st(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    """Real sentences of varied length plus edge cases: empty, one character, non-ASCII, past max_length."""
    base = [
        "A man is playing a guitar.",
        "Someone plays guitar on a stage.",
        "The cat sits on the mat.",
        "A woman is slicing an onion.",
        "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
        "",
        "a",
        "Café crème, naïve façade — 東京タワー и Москва.",
        "Ein Mann spielt Gitarre.",
        "The quick brown fox jumps over the lazy dog. " * 40,  # ~400 tokens: past MiniLM's 256
        "Protein folding remains one of the central problems of computational biology.",
        "?!",
        "Two dogs run through a field of tall grass while the owner watches from a distance.",
    ]
    return base


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def link_copy(src: Path, dst: Path, skip: set[str]) -> Path:
    """``dst`` with a symlink to every entry of ``src`` (weights included) except those in ``skip``."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in skip:
            (dst / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return dst
