"""The layers point one way (docs/architecture.md), read from the source: every import statement,
function-level and TYPE_CHECKING ones included, not what happens to be imported at test time.

- No import circle among titanite's modules.
- Each module imports only what its layer may (LAYERS below: docs/architecture.md's table as
  data); every module belongs to a layer.
- Nothing the model layer imports, directly or through other titanite modules, reaches the
  parallel layer, the trainer or torch.distributed.

Each rule has a companion test showing that its check can fail. The device rules (torch.cuda,
device-type strings) are in test_device_layer.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "titanite"
# The only modules at titanite/'s top level: the package, the CLI dispatch, `python -m titanite.train`
# and the Python API. Everything else lives in its layer's package.
ENTRY_POINTS = ("titanite", "titanite.cli", "titanite.train", "titanite.api")
MAX_TOP_LEVEL = 6
FORBIDDEN_FOR_MODELS = ("titanite.parallel", "titanite.run.trainer", "torch.distributed")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    module = _module_name(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported(tree: ast.AST, package: str) -> Iterator[tuple[ast.stmt, str]]:
    """(statement, absolute module name) for every import in `tree` (`from a import b` yields a and
    a.b); `package` anchors relative imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield node, base
            yield from ((node, f"{base}.{alias.name}") for alias in node.names)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (`from a import b` yields a and a.b)."""
    return {name for _, name in _imported(ast.parse(path.read_text(), str(path)), _package(path))}


def import_graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, graph: dict[str, set[str]]) -> list[str]:
    """The titanite modules that importing `name` executes: it and its parent packages."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in graph]


def reachable(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every titanite module importing `start` executes -> the module that imported it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        current = todo.pop()
        for name in graph[current]:
            for target in _resolve(name, graph):
                if target not in seen:
                    seen[target] = current
                    todo.append(target)
    return seen


def _chain(module: str, parents: dict[str, str]) -> str:
    chain = [module]
    while parents[chain[-1]]:
        chain.append(parents[chain[-1]])
    return " <- ".join(chain)


def test_the_model_layer_never_reaches_parallel_trainer_or_torch_distributed():
    graph = import_graph()
    models = sorted(m for m in graph if m == "titanite.models" or m.startswith("titanite.models."))
    assert "titanite.models.qwen3.model" in models and "titanite.models.hf.handle" in models
    violations = []
    for start in models:
        parents = reachable(start, graph)
        for module in parents:
            bad = sorted(name for name in graph[module] if name.startswith(FORBIDDEN_FOR_MODELS))
            if bad:
                violations.append(f"{bad[0]} imported by {_chain(module, parents)}")
    assert not violations, "\n".join(sorted(set(violations)))


def test_the_check_sees_an_indirect_import(tmp_path):
    """The graph walk itself: a forbidden import two modules away is found, with its chain."""
    graph = {"titanite.models.a": {"titanite.util"}, "titanite.util": {"torch.distributed"},
             "titanite": set(), "titanite.models": set()}
    parents = reachable("titanite.models.a", graph)
    assert "titanite.util" in parents
    assert _chain("titanite.util", parents) == "titanite.util <- titanite.models.a"


def test_no_import_cycle_between_the_spec_registry_and_the_backends():
    graph = import_graph()
    spec_reach = reachable("titanite.models.spec", graph)
    for backend in ("titanite.models.qwen3.handle", "titanite.models.hf.handle"):
        assert backend not in spec_reach  # the registry loads backends by path, on first use
        assert "titanite.models.spec" not in reachable(backend, graph)


# -- module edges: what each import statement really uses --------------------------------------


def _deepest(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    return next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in modules), None)


def module_edges() -> dict[str, set[str]]:
    """titanite module -> the titanite modules it imports. `from a import b` is an edge to `a.b`
    when that is a module, else to `a` (the package whose `__init__` holds `b`): importing a
    submodule also runs its parent packages, but that is Python's order of execution, not a
    dependency of the importer, and counting it would tie every package to its own `__init__`."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(_deepest(alias.name, modules) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = next(name for stmt, name in _imported(node, _package(path)) if stmt is node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else _deepest(base, modules))
        edges[module] = {m for m in found if m is not None and m != module}
    return edges


# -- no import circle ----------------------------------------------------------------------------


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_among_titanites_modules():
    edges = module_edges()
    assert "titanite.kernels.registry" in edges and len(edges) > 100
    found = circles(edges)
    assert not found, "import circles (each a set of modules that import one another):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}, "f": {"g"}, "g": {"f"}}
    assert circles(edges) == [["a", "b", "c"], ["f", "g"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# -- the layer table -------------------------------------------------------------------------------

# docs/architecture.md's layer table as data, bottom up: one package per layer, and the entry points
# at titanite/'s top level. layer: (its package or modules, what it may import besides itself).
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "core": (("titanite.core",), ()),
    "device": (("titanite.device",), ("core",)),
    "kernels": (("titanite.kernels",), ("core",)),
    "formats": (("titanite.formats",), ("core",)),
    "models": (("titanite.models",), ("kernels", "formats", "core")),
    "parallel": (("titanite.parallel",), ("models", "kernels", "formats", "device", "core")),
    "data": (("titanite.data",), ("titanite.kernels.reference_ops", "core")),
    "checkpoint": (("titanite.checkpoint",), ("parallel", "formats", "device", "core")),
    "evaluation": (("titanite.evaluation",), ("data", "parallel", "models", "formats", "kernels", "device", "core")),
    "run": (("titanite.run",),
            ("evaluation", "checkpoint", "data", "parallel", "models", "formats", "kernels", "device", "core")),
    "plan": (("titanite.plan",),
             ("run", "evaluation", "checkpoint", "data", "parallel", "models", "formats", "kernels", "device", "core")),
    "commands": (("titanite.commands",), ("titanite.api", "plan", "run", "evaluation", "checkpoint", "data", "parallel", "models",
                                          "formats", "kernels", "device", "core")),
    "entry": (ENTRY_POINTS, ("commands", "plan", "run", "evaluation", "checkpoint", "data", "parallel", "models",
                             "formats", "kernels", "device", "core")),
}
# Single modules allowed more than their layer: the kernel benchmark times ops on a device.
EXTRA = {"titanite.kernels.bench": ("device",)}


def _owner(module: str, layers: dict) -> str | None:
    """The layer of `module`: the one naming it or its longest enclosing package."""
    best, length = None, -1
    for layer, (members, _) in layers.items():
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > length:
                best, length = layer, len(m)
    return best


def layer_violations(edges: dict[str, set[str]], layers: dict, extra: dict) -> list[str]:
    found = []
    for module in sorted(edges):
        layer = _owner(module, layers)
        if layer is None:
            found.append(f"{module} is in no layer of the table")
            continue
        allowed = (*layers[layer][1], *extra.get(module, ()))
        for target in sorted(edges[module]):
            there = _owner(target, layers)
            ok = there == layer or there in allowed or any(target == a or target.startswith(a + ".") for a in allowed)
            if not ok:
                found.append(f"{module} ({layer}) imports {target} ({there}), which its layer may not")
    return found


def test_every_module_imports_only_what_its_layer_may():
    violations = layer_violations(module_edges(), LAYERS, EXTRA)
    assert not violations, "\n".join(violations)


def test_the_layer_check_names_each_violation():
    layers = {"low": (("pkg.low",), ()), "high": (("pkg.high",), ("low",)), "side": (("pkg.side",), ("pkg.low.x",))}
    edges = {"pkg.low.a": {"pkg.high.b"}, "pkg.high.b": {"pkg.low.a"}, "pkg.side": {"pkg.low.x", "pkg.low.a"},
             "pkg.stray": set()}
    assert layer_violations(edges, layers, {}) == [
        "pkg.low.a (low) imports pkg.high.b (high), which its layer may not",
        "pkg.side (side) imports pkg.low.a (low), which its layer may not",
        "pkg.stray is in no layer of the table",
    ]
    assert layer_violations({"pkg.low.a": {"pkg.high.b"}}, layers, {"pkg.low.a": ("high",)}) == []


# -- one package per layer -------------------------------------------------------------------------


def package_violations(modules: set[str], layers: dict, entry: tuple[str, ...], most: int) -> list[str]:
    """Each layer but the entry points is one package; the top level holds only the entry points
    (at most `most` modules); every package directly under titanite/ is a layer's."""
    found = []
    for layer, (members, _) in layers.items():
        if members != entry and (len(members) != 1 or not any(m.startswith(members[0] + ".") for m in modules)):
            found.append(f"layer {layer} is not one package: {', '.join(members)}")
    top = sorted(m for m in modules if m.count(".") == 1 and not any(o.startswith(m + ".") for o in modules))
    found += [f"{m} sits at titanite/'s top level but is no entry point; move it to its layer's package"
              for m in top if m not in entry]
    if len(top) + 1 > most:
        found.append(f"{len(top) + 1} modules at titanite/'s top level (at most {most})")
    packages = {".".join(m.split(".")[:2]) for m in modules if m.count(".") >= 2}
    owned = {members[0] for members, _ in layers.values() if members != entry}
    found += [f"package {p} is no layer's" for p in sorted(packages - owned)]
    return found


def test_each_layer_is_one_package_and_the_top_level_holds_only_entry_points():
    modules = set(import_graph())
    assert "titanite.run.trainer" in modules
    violations = package_violations(modules, LAYERS, ENTRY_POINTS, MAX_TOP_LEVEL)
    assert not violations, "\n".join(violations)


def test_the_package_check_finds_a_stray_module_and_a_split_layer():
    layers = {"low": (("t.low",), ()), "mid": (("t.mid", "t.other"), ("low",)), "entry": (("t", "t.cli"), ("low",))}
    modules = {"t", "t.cli", "t.low", "t.low.a", "t.mid", "t.mid.b", "t.other", "t.other.c", "t.stray", "t.extra.d"}
    assert package_violations(modules, layers, ("t", "t.cli"), 2) == [
        "layer mid is not one package: t.mid, t.other",
        "t.stray sits at titanite/'s top level but is no entry point; move it to its layer's package",
        "3 modules at titanite/'s top level (at most 2)",
        "package t.extra is no layer's",
        "package t.other is no layer's",
    ]
