"""Only the device layer (titanite/device/) names torch.cuda or compares a device-type string,
so every native PyTorch device (CPU, CUDA, neuron, the test device tdev, ...) shares one code
path. Read from the source, with companion tests that show each check can fail."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.architecture.test_layers import PACKAGE, _imported
from tests.conftest import REPO

DEVICE_LAYER = PACKAGE / "device"
# Device-type names no code outside the device layer may compare against ("tdev": the test device).
DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "meta", "hpu", "neuron", "mtia", "privateuseone", "tdev"})


def _outside_the_device_layer() -> list[Path]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if DEVICE_LAYER not in p.parents)
    assert DEVICE_LAYER.is_dir() and len(files) > 50  # the walk sees the package, not an empty folder
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
    assert not violations, "torch.cuda outside titanite/device/ (ask titanite.device):\n" + "\n".join(violations)


def test_nothing_outside_the_device_layer_compares_a_device_type_string():
    violations = _check_package(device_string_comparisons)
    assert not violations, ("a device-type string compared outside titanite/device/ (ask a predicate there, "
                            "e.g. device.choice.is_host):\n" + "\n".join(violations))


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
