"""Kernel seams. The native model reaches its replaceable math only through `op(name)`.

Each op has a pure-PyTorch reference in `titanite.kernels.reference_ops`; `reference(name)`
returns it. Other implementations register against the same signature.
"""

from __future__ import annotations

from collections.abc import Callable

from titanite.errors import UserError, did_you_mean
from titanite.kernels import reference_ops

_REFERENCE: dict[str, Callable] = {
    "rms_norm": reference_ops.rms_norm,
    "rope": reference_ops.rope,
    "attention": reference_ops.attention,
    "swiglu": reference_ops.swiglu,
}


def reference(name: str) -> Callable:
    """The op's pure-PyTorch reference implementation (the oracle every kernel is checked against)."""
    if name not in _REFERENCE:
        raise UserError(f"unknown kernel op '{name}'{did_you_mean(name, _REFERENCE)}; ops: {', '.join(sorted(_REFERENCE))}")
    return _REFERENCE[name]


def op(name: str) -> Callable:
    """The implementation a module binds at construction time."""
    return reference(name)
