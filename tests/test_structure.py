"""The structure rules of ``lab/`` and ``kernels/``, checked by reading the source (an AST scan, nothing imported):

- no import cycles among ``lab`` modules, function-level imports included;
- no module imports another's private (``_name``) names;
- nothing outside ``engine.py`` touches an engine's private attributes (``engine._x``), here or in ``evals/``;
- model code (``lab/models``) imports only the model layer (``lab.models``, ``lab.batch``, ``lab.attention``,
  ``lab.kernels``): never the engine, scheduler, executor or studies;
- models are not probed with ``hasattr`` / ``getattr`` outside ``lab/models`` (the ``PackedModel`` contract says
  what a model has);
- ``kernels/`` imports nothing from ``lab`` but itself (installed as ``lab.kernels``);
- every module stays under 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB, KERNELS = ROOT / "lab", ROOT / "kernels"
MODEL_LAYER = ("lab.models", "lab.batch", "lab.attention", "lab.kernels")
ENGINE_NAMES = {"engine", "eng", "self.engine", "self.eng", "reng"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


LAB_MODULES = {module_name(p): p for p in sorted(LAB.rglob("*.py"))}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports(path: Path, package: str) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every import in ``path`` (any depth), absolute names."""
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def lab_target(name: str) -> str | None:
    """The ``lab`` module an import resolves to (the longest known prefix); ``lab.kernels`` is outside ``lab/``."""
    if not (name == "lab" or name.startswith("lab.")) or name.startswith("lab.kernels"):
        return None
    while name and name not in LAB_MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for mod, path in LAB_MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for name, names, _ in imports(path, package):
            for full in [f"{name}.{n}" for n in names if f"{name}.{n}" in LAB_MODULES] or [name]:
                target = lab_target(full)
                if target and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_scan_sees_the_package():
    graph = import_graph()
    assert {"lab.engine", "lab.executor", "lab.kv_path", "lab.pooling", "lab.heads", "lab.models.base"} <= set(graph)
    assert {"lab.executor", "lab.call", "lab.heads"} <= graph["lab.engine"]  # the scan reads real edges
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # and finds a cycle


def test_no_import_cycles_in_lab():
    assert cycles(import_graph()) == []


def test_no_private_names_imported_across_modules():
    bad = []
    for path in [*LAB_MODULES.values(), *sorted((ROOT / "evals").rglob("*.py")), *sorted(KERNELS.rglob("*.py"))]:
        for name, names, line in imports(path, module_name(path).rpartition(".")[0]):
            if name.startswith(("lab", "evals", "kernels")):
                bad += [f"{path.relative_to(ROOT)}:{line} imports {n} from {name}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_nothing_outside_engine_touches_engine_internals():
    bad = []
    for path in [*LAB_MODULES.values(), *sorted((ROOT / "evals").rglob("*.py"))]:
        if path == LAB / "engine.py":
            continue
        for node in ast.walk(parse(path)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and ast.unparse(node.value) in ENGINE_NAMES):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_model_code_imports_only_the_model_layer():
    bad = []
    for mod, path in LAB_MODULES.items():
        if not mod.startswith("lab.models"):
            continue
        for name, _, line in imports(path, "lab.models"):
            if name.startswith("lab") and not name.startswith(MODEL_LAYER):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


def test_models_are_not_probed_with_hasattr_outside_the_model_code():
    bad = []
    for mod, path in LAB_MODULES.items():
        if mod.startswith("lab.models"):
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr",
                                                                                                   "getattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if target == "model" or target.endswith(".model") or ".model." in target:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_kernels_import_nothing_from_lab():
    bad = []
    for path in sorted(KERNELS.rglob("*.py")):
        for name, _, line in imports(path, "lab.kernels"):
            if name.startswith("lab") and not name.startswith("lab.kernels"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


@pytest.mark.parametrize("path", [*LAB_MODULES.values(), *sorted(KERNELS.rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n < 600, f"{path.relative_to(ROOT)} has {n} lines; split it by concern"
