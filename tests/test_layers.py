"""The layers point one way (docs/architecture.md): nothing the model layer imports, directly or
through other titanite modules, reaches the parallel layer, the trainer or torch.distributed.

The import graph is read from the source (every import statement, function-level ones included),
not from what happens to be imported at test time.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "titanite"
FORBIDDEN_FOR_MODELS = ("titanite.parallel", "titanite.trainer", "torch.distributed")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (`from a import b` yields a and a.b)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


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
