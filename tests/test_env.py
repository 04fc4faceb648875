"""Every ``LAB_*`` environment variable is read through ``lab.env`` (its readers live in ``lab.kernels.env``): a
switch takes 1/0, true/false, yes/no, on/off in any case and refuses anything else naming the variable, a folder
variable naming a file fails naming the variable, and ``lab.env.VARIABLES`` lists every name the source reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lab.kernels import cpu_attention

from lab import env
from lab.ops import probes

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    *sorted((ROOT / "lab").rglob("*.py")),
    *sorted((ROOT / "kernels").rglob("*.py")),
    *sorted(p for p in (ROOT / "evals").rglob("*.py") if "llm2vec_ref" not in p.parts),
]


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("ON", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", None),
    ],
)
def test_a_switch_takes_every_spelling(monkeypatch, value, want):
    monkeypatch.setenv("LAB_TEST_SWITCH", value)
    assert env.flag("LAB_TEST_SWITCH", True) is (True if want is None else want)
    assert env.flag("LAB_TEST_SWITCH", False) is (False if want is None else want)


@pytest.mark.parametrize("value", ["2", "of", "ture", " 1", "enabled"])
def test_a_switch_refuses_anything_else_naming_it(monkeypatch, value):
    monkeypatch.setenv("LAB_TEST_SWITCH", value)
    with pytest.raises(
        ValueError,
        match=rf"LAB_TEST_SWITCH={re.escape(repr(value))} is not a valid value: use "
        r"LAB_TEST_SWITCH=1 \(or true, yes, on\).*LAB_TEST_SWITCH=0 \(or false, no, "
        r"off\).*unset for the default \(on\)",
    ):
        env.flag("LAB_TEST_SWITCH", True)


@pytest.mark.parametrize("value", ["0", "off", "false", "no", "OFF"])
def test_every_off_spelling_turns_the_c_kernels_off(monkeypatch, value):
    monkeypatch.setattr(cpu_attention, "_LIB", None)
    monkeypatch.setattr(cpu_attention, "_REASON", None)
    monkeypatch.setenv("LAB_CPU_NATIVE_KERNELS", value)
    assert not cpu_attention.available()
    assert f"disabled by LAB_CPU_NATIVE_KERNELS={value}" in cpu_attention.unavailable_reason()


def test_a_typo_in_the_kernel_switch_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_LIB", None)
    monkeypatch.setattr(cpu_attention, "_REASON", None)
    monkeypatch.setenv("LAB_CPU_NATIVE_KERNELS", "flase")
    with pytest.raises(ValueError, match=r"LAB_CPU_NATIVE_KERNELS='flase' is not a valid value"):
        cpu_attention.available()


def test_a_choice_is_matched_in_any_case_and_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("LAB_CPU_TEST_PATH", "Stacked")
    assert env.choice("LAB_CPU_TEST_PATH", ("split", "stacked", "auto"), "auto") == "stacked"
    monkeypatch.setenv("LAB_CPU_TEST_PATH", "sideways")
    with pytest.raises(
        ValueError,
        match=r"LAB_CPU_TEST_PATH='sideways' is not an accepted value; valid: split, "
        r"stacked, auto \(unset: auto\)",
    ):
        env.choice("LAB_CPU_TEST_PATH", ("split", "stacked", "auto"), "auto")


def test_a_folder_variable_naming_a_file_is_refused_naming_it(monkeypatch, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    for value, what in ((f, "is a file"), (f / "sub", f"is under {f}, which is a file")):
        monkeypatch.setenv("LAB_KERNEL_CACHE", str(value))
        with pytest.raises(
            ValueError,
            match=rf"LAB_KERNEL_CACHE={re.escape(repr(str(value)))} {re.escape(what)}, "
            r"not a folder: point LAB_KERNEL_CACHE at a folder",
        ):
            cpu_attention.cache_dir()
    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path / "new" / "folder"))  # absent: created on first build
    assert cpu_attention.cache_dir() == tmp_path / "new" / "folder"


def test_every_lab_variable_is_read_through_lab_env():
    """No module reads a ``LAB_*`` variable from ``os.environ`` itself (writing one, or forwarding them all to Ray
    actors, is not reading one), and every name the source mentions is in ``lab.env.VARIABLES``."""
    read = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*f?["']LAB_""")
    direct = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in SOURCES
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if read.search(line) and not re.search(r"environ\[[^]]+\]\s*=[^=]", line)
    ]
    assert direct == [], "read these through lab.env (flag / path / choice): " + ", ".join(direct)
    names = {m for p in SOURCES for m in re.findall(r"\bLAB_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(encoding="utf-8"))}
    cpu_paths = {n for n in names if n.startswith("LAB_CPU_") and n not in env.VARIABLES}
    assert names - cpu_paths - {"LAB_CPU"} <= set(env.VARIABLES), sorted(names - cpu_paths - set(env.VARIABLES))
    table = env.table()
    assert all(f"| `{name}` |" in table for name in env.VARIABLES)


def test_an_unknown_cpu_path_variable_is_refused(monkeypatch, minilm_path):
    """A ``LAB_CPU_<NAME>`` with a typo in its name would force nothing; the engine refuses it before loading,
    naming it and the valid names."""
    from lab import Engine

    monkeypatch.setenv("LAB_CPU_BF16_GEM", "widened")
    with pytest.raises(ValueError, match=r"LAB_CPU_BF16_GEM: no such CPU fast path; .*LAB_CPU_BF16_GEMM"):
        Engine(minilm_path)
    monkeypatch.delenv("LAB_CPU_BF16_GEM")
    monkeypatch.setenv("LAB_CPU_BF16_GEMM", "widened")  # a real name is no error
    probes.check_environment()
