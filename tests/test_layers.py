"""The layers point one way (docs/architecture.md): nothing the model layer imports, directly or
through other titanite modules, reaches the parallel layer, the trainer or torch.distributed.
And only the device layer (titanite/device.py) names torch.cuda or compares a device-type string,
so every native PyTorch device (CPU, CUDA, neuron, ...) shares one code path.

The import graph is read from the source (every import statement, function-level ones included),
not from what happens to be imported at test time.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "titanite"
FORBIDDEN_FOR_MODELS = ("titanite.parallel", "titanite.trainer", "torch.distributed")
DEVICE_LAYER = PACKAGE / "device.py"
# Device-type names no code outside the device layer may compare against ("tdev": the test device).
DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "meta", "hpu", "neuron", "mtia", "privateuseone", "tdev"})


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


# -- Only the device layer names an accelerator --------------------------------------------------


def _outside_the_device_layer() -> list[Path]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if p != DEVICE_LAYER)
    assert DEVICE_LAYER.exists() and len(files) > 50  # the walk sees the package, not an empty folder
    return files


def _where(source: str, filename: str, node: ast.AST) -> str:
    return f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}"


def _line(source: str, filename: str, node: ast.AST) -> str:
    return f"{filename}:{node.lineno}: {source.splitlines()[node.lineno - 1].strip()}"


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a chain of attributes on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def torch_cuda_uses(source: str, filename: str) -> list[str]:
    """`file:line: line` for each line that imports torch.cuda (`import torch.cuda`, `from torch
    import cuda`, `from torch.cuda import x`) or reaches an attribute through torch.cuda, also where
    torch is imported under another name."""
    tree = ast.parse(source, filename)
    torch_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names if alias.name == "torch"}
    found = [node for node, name in _imported(tree, package="")  # torch.cuda is never a relative import
             if name == "torch.cuda" or name.startswith("torch.cuda.")]
    found += [node for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "cuda" and _dotted(node.value) in torch_names]
    return [where for _, where in sorted({(node.lineno, _line(source, filename, node)) for node in found})]


def _device_names(node: ast.AST) -> list[str]:
    """The device types a comparison operand spells: a string constant ("cuda", "cuda:0") or a
    tuple / list / set of them."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    values = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return [v for v in values if v.split(":")[0] in DEVICE_TYPES]


_COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def device_string_comparisons(source: str, filename: str) -> list[str]:
    """`file:line: source` for each comparison (==, !=, in, not in, is, is not; also a `case`
    pattern) with a device-type string on either side. Declarations such as
    `register(..., devices=("cpu", "cuda"))` or `torch.device("meta")` compare nothing."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(op, _COMPARISONS) and (_device_names(a) or _device_names(b))
                   for op, a, b in zip(node.ops, operands, operands[1:])):
                found.append((node.lineno, _where(source, filename, node)))
        elif isinstance(node, ast.MatchValue) and _device_names(node.value):
            found.append((node.lineno, _where(source, filename, node)))
    return [where for _, where in sorted(found)]


def _check_package(check: Callable[[str, str], list[str]]) -> list[str]:
    return [where for path in _outside_the_device_layer()
            for where in check(path.read_text(), str(path.relative_to(REPO)))]


def test_nothing_outside_the_device_layer_names_torch_cuda():
    violations = _check_package(torch_cuda_uses)
    assert not violations, "torch.cuda outside titanite/device.py (ask titanite.device):\n" + "\n".join(violations)


def test_nothing_outside_the_device_layer_compares_a_device_type_string():
    violations = _check_package(device_string_comparisons)
    assert not violations, ("a device-type string compared outside titanite/device.py (ask a predicate there, "
                            "e.g. device.is_host):\n" + "\n".join(violations))


def test_the_torch_cuda_check_reports_each_use_with_file_and_line():
    source = """import torch
import torch as T
import torch.cuda
from torch import cuda, nn
from torch.cuda import amp

ok = torch.accelerator.is_available() and torch.device("cuda")
n = torch.cuda.device_count()
T.cuda.synchronize()
"""
    assert torch_cuda_uses(source, "titanite/fake.py") == [
        "titanite/fake.py:3: import torch.cuda",
        "titanite/fake.py:4: from torch import cuda, nn",
        "titanite/fake.py:5: from torch.cuda import amp",
        "titanite/fake.py:8: n = torch.cuda.device_count()",
        "titanite/fake.py:9: T.cuda.synchronize()"]


def test_the_device_string_check_reports_each_comparison_with_file_and_line():
    source = """import torch

@register("rms_norm", "fast", devices=("cpu", "cuda"))
def f(x, device, device_type, name):
    w = torch.empty(3, device="meta")
    if name == "float32" or device_type in SUPPORTED:
        return x
    big = device.type != "cpu"
    if device_type not in ("cuda", "xpu"):
        return str(device) == "cuda:0"
    if "tdev" == device.type or device_type is "mps":
        pass
    match device_type:
        case "neuron":
            pass
"""
    assert device_string_comparisons(source, "titanite/fake.py") == [
        'titanite/fake.py:8: device.type != "cpu"',
        'titanite/fake.py:9: device_type not in ("cuda", "xpu")',
        'titanite/fake.py:10: str(device) == "cuda:0"',
        'titanite/fake.py:11: "tdev" == device.type',
        'titanite/fake.py:11: device_type is "mps"',
        'titanite/fake.py:14: "neuron"']
