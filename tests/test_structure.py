"""The structure rules of ``lab/`` and ``kernels/``, checked by reading the source (an AST scan, nothing imported):

- the layers are subpackages, and each may import only the layers below it (``LAYERS``; function-level imports
  included), so the folder names tell where a thing goes and what it may know;
- no import cycles among ``lab`` modules;
- no module imports another's private (``_name``) names;
- nothing outside ``lab/engine/`` touches an engine's private attributes (``engine._x``), here or in ``evals/``, and
  the Engine hands no private method out as a callback (its collaborators get public seams);
- models are not probed with ``hasattr`` / ``getattr`` outside ``lab/models`` (the ``PackedModel`` contract says
  what a model has);
- ``kernels/`` imports nothing from ``lab`` but itself (installed as ``lab.kernels``);
- no module of ``lab/`` or ``kernels/`` and no evals/ script past 600 lines (split it by concern), the Engine facade
  under 450; lab/ imports nothing from evals/;
- warnings are raised through ``lab._warn.warn`` (attributed to the caller's line outside the package);
- ``kernels/`` defines none of the product's vocabulary (the names users choose from: pooling knob values past the
  kernels' own reductions, output kinds, score modes, instruction rules, long-input modes); lab's registries do
  (this one check imports them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB, KERNELS = ROOT / "lab", ROOT / "kernels"
# layer -> the layers it may import (besides itself, ``lab.kernels`` and the package helpers ``lab._lazy`` /
# ``lab._repo`` / ``lab._extras`` / ``lab.env``), bottom to top. ``lab`` itself (``__init__``, ``demo``) sits above
# them all.
LAYERS = {
    "lab.ops": set(),  # batch layout, attention / GEMM dispatch, CPU probes and plan
    "lab.models": {"lab.ops"},  # families on flat tokens + AttnMeta, loading
    "lab.runtime": {"lab.ops", "lab.models"},  # weights, CPU planning, worker pool, runner
    "lab.outputs": {"lab.ops"},  # pooling, heads, output kinds, scoring, quantize
    "lab.adapt": {"lab.ops", "lab.models"},  # LoRA adapters (merged live), MNTP / SimCSE training
    "lab.engine": {"lab.ops", "lab.models", "lab.runtime", "lab.outputs", "lab.adapt"},
    "lab.eval": {"lab.ops", "lab.models", "lab.runtime", "lab.outputs", "lab.adapt", "lab.engine"},
    "lab.distributed": {"lab.ops", "lab.models", "lab.runtime", "lab.outputs", "lab.adapt", "lab.engine", "lab.eval"},
}
HELPERS = {"lab._lazy", "lab._repo", "lab._extras", "lab.env", "lab._files", "lab._warn"}
# the one upward edge: the Engine facade opens its front-ends (``Engine.panel()``, ``Engine.as_mteb_model()``),
# imported inside those methods; nothing they import reaches back into the facade
FRONT_ENDS = {"lab.engine.engine": {"lab.eval.panel", "lab.eval.mteb_adapter"}}
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


def layer(module: str) -> str:
    """The layer (``LAYERS`` key) a ``lab`` module belongs to; ``lab`` for the package's own top-level modules."""
    return next((name for name in LAYERS if module == name or module.startswith(name + ".")), "lab")


def test_scan_sees_the_package():
    graph = import_graph()
    assert {
        "lab.engine.engine",
        "lab.engine.executor",
        "lab.engine.kv_path",
        "lab.outputs.pooling",
        "lab.outputs.heads",
        "lab.models.base",
        "lab.ops.gemm",
    } <= set(graph)
    assert {"lab.engine.executor", "lab.engine.call", "lab.engine.passes"} <= graph["lab.engine.engine"]  # real edges
    assert "lab.outputs.heads" in graph["lab.engine.passes"]
    assert {layer(m) for m in graph} <= set(LAYERS) | {"lab"}  # every module sits in a layer
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # and finds a cycle


def test_no_import_cycles_in_lab():
    assert cycles(import_graph()) == []


def test_no_private_names_imported_across_modules():
    bad = []
    for path in [*LAB_MODULES.values(), *sorted((ROOT / "evals").rglob("*.py")), *sorted(KERNELS.rglob("*.py"))]:
        for name, names, line in imports(path, module_name(path).rpartition(".")[0]):
            if name.startswith(("lab", "evals", "kernels")):
                bad += [
                    f"{path.relative_to(ROOT)}:{line} imports {n} from {name}"
                    for n in names
                    if n.startswith("_") and not n.startswith("__")
                ]
    assert bad == []


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, deps in import_graph().items():
        if layer(mod) == "lab":
            continue
        allowed = LAYERS[layer(mod)] | {layer(mod)}
        for dep in sorted(deps - HELPERS - FRONT_ENDS.get(mod, set())):
            if layer(dep) not in allowed:
                bad.append(f"{mod} ({layer(mod)}) imports {dep} ({layer(dep)})")
    assert bad == []


def test_the_layers_form_no_cycle():
    graph = {name: set(below) for name, below in LAYERS.items()}
    assert cycles(graph) == [] and all(name not in below for name, below in graph.items())
    for mod, targets in FRONT_ENDS.items():  # the front-ends never import the facade back
        graph = import_graph()
        for target in targets:
            assert mod not in reachable(graph, target), f"{target} reaches back into {mod}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_nothing_outside_engine_touches_engine_internals():
    bad = []
    for path in [*LAB_MODULES.values(), *sorted((ROOT / "evals").rglob("*.py"))]:
        if LAB / "engine" in path.parents:
            continue
        for node in ast.walk(parse(path)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and ast.unparse(node.value) in ENGINE_NAMES
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_the_engine_hands_out_no_private_callbacks():
    """``Engine`` passes no ``self._method`` as an argument: rerank, ``encode`` and the rest call its public seams."""
    tree = parse(LAB / "engine" / "engine.py")
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = {
        n.name
        for n in engine.body
        if isinstance(n, ast.FunctionDef)
        and not any(ast.unparse(d) in ("property", "cached_property") for d in n.decorator_list)
    }
    bad = []
    for node in ast.walk(engine):
        if isinstance(node, ast.Call):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if (
                    isinstance(arg, ast.Attribute)
                    and isinstance(arg.value, ast.Name)
                    and arg.value.id == "self"
                    and arg.attr.startswith("_")
                    and arg.attr in methods
                ):
                    bad.append(f"line {node.lineno}: {ast.unparse(arg)} handed to {ast.unparse(node.func)}")
    assert bad == []


def test_models_are_not_probed_with_hasattr_outside_the_model_code():
    bad = []
    for mod, path in LAB_MODULES.items():
        if mod.startswith("lab.models"):
            continue
        for node in ast.walk(parse(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
            ):
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


def test_lab_imports_nothing_from_evals():
    """The repository's evals/ (benchmarks, studies) sits above the package: lab/ never reaches into it."""
    bad = []
    for mod, path in LAB_MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for name, _, line in imports(path, package):
            if name == "evals" or name.startswith("evals."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


def test_warnings_go_through_lab_warn():
    """Every warning of the package is raised by ``lab._warn.warn``, which names the caller's line outside the
    package (a ``stacklevel`` counted by hand points inside it once a call path gains or loses a frame)."""
    bad = []
    for mod, path in LAB_MODULES.items():
        if mod == "lab._warn":
            continue
        for node in ast.walk(parse(path)):
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and f.attr == "warn" and getattr(f.value, "id", None) == "warnings":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} calls warnings.warn; use lab._warn.warn")
    assert bad == []


@pytest.mark.parametrize("path", sorted((ROOT / "evals").glob("*.py")), ids=lambda p: p.name)
def test_evals_scripts_stay_under_600_lines(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines; split it into a library part and a CLI part"


@pytest.mark.parametrize(
    "path",
    [*LAB_MODULES.values(), *sorted(KERNELS.rglob("*.py")), *sorted(KERNELS.glob("*.[ch]"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_modules_stay_small(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines; past 600 a module holds two concerns: split it"


def test_the_engine_is_a_thin_face():
    """``Engine`` reads like the README's tour: the work lives in the modules it calls (knobs, passes, live
    settings, adapters, windows, rerank, st_encode)."""
    n = len((LAB / "engine" / "engine.py").read_text(encoding="utf-8").splitlines())
    assert n < 450, f"lab/engine/engine.py has {n} lines; move what is not the facade into its own module"


def module_strings(path: Path) -> set[str]:
    """The string constants of ``path``'s module-level assignments (its tables and constants)."""
    out = set()
    for node in parse(path).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            out |= {n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


def test_kernels_define_no_product_vocabulary():
    from lab.kernels.reference import SEGMENT_REDUCTIONS

    from lab.engine.framing import INSTRUCTION_POOLING
    from lab.engine.knob_registry import LONG_INPUTS
    from lab.engine.rerank import SCORE_MODES
    from lab.outputs.kinds import KINDS
    from lab.outputs.pooling import METHODS

    vocabulary = (
        (set(METHODS) - set(SEGMENT_REDUCTIONS))
        | set(KINDS)
        | set(SCORE_MODES)
        | set(INSTRUCTION_POOLING)
        | set(LONG_INPUTS)
    )
    assert {"eos_token", "colbert", "bi-encoder", "llm2vec", "chunk"} <= vocabulary  # the registries are read
    bad = {str(p.relative_to(ROOT)): sorted(module_strings(p) & vocabulary) for p in sorted(KERNELS.rglob("*.py"))}
    assert {path: names for path, names in bad.items() if names} == {}
