"""The override registry: op name -> implementations, each checked against the op's reference.

An op is a named piece of replaceable math with a pure-PyTorch reference (`reference_ops`).
An implementation registers under the op with a name, the device types and dtypes it runs on
and, optionally, a check for anything else it needs (a package, an environment). Its Python
signature must match the reference's: same parameter names, in the same order, with the same
defaults, so a call site written against the reference calls any implementation.

The registry imports no implementation: the built-in ones register themselves when the package
`titanite.kernels` is imported (its `__init__` imports them), which happens before any of its
modules, this one included, so whatever reaches the registry sees them; plugins register when
`load_plugins` imports them.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import titanite.kernels.reference_delta as reference_delta
import titanite.kernels.reference_ops as reference_ops
from titanite.core.errors import UserError, did_you_mean

log = logging.getLogger("titanite")

REFERENCE = "reference"

# op -> (reference function, one-line summary for `titanite kernels list`).
OPS: dict[str, tuple[Callable, str]] = {
    "attention": (reference_ops.attention, "causal GQA attention, optionally block-causal over packed documents"),
    "rms_norm": (reference_ops.rms_norm, "RMSNorm over the last dim"),
    "rope": (reference_ops.rope, "rotary position embedding on q and k"),
    "swiglu": (reference_ops.swiglu, "silu(gate) * up"),
    "moe.router": (reference_ops.moe_router, "router scores (softmax, fp32) and top-k"),
    "moe.dispatch": (reference_ops.moe_dispatch, "permute tokens to experts, run them, un-permute and weight"),
    "moe.experts": (reference_ops.moe_experts, "grouped SwiGLU MLP over expert-sorted tokens"),
    "loss": (reference_ops.linear_cross_entropy, "final linear + summed cross-entropy"),
    "gated_delta": (reference_delta.gated_delta, "the gated delta rule (Gated DeltaNet), restarting at packed documents"),
    "short_conv": (reference_delta.short_conv, "causal depthwise convolution + SiLU, restarting at packed documents"),
    "rms_norm_gated": (reference_delta.rms_norm_gated, "RMSNorm(x) * silu(gate) over the last dim"),
}


@dataclass(frozen=True)
class Impl:
    """One registered implementation of an op."""

    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...] | None  # device types (torch.device.type); None = any
    dtypes: tuple[torch.dtype, ...] | None  # compute dtypes; None = any
    requires: Callable[[str, torch.dtype], str | None] | None  # -> why it cannot run here, or None
    source: str  # the module that registered it

    def unavailable(self, device_type: str, dtype: torch.dtype | None = None) -> str | None:
        """Why this implementation cannot run on `device_type` / `dtype`, or None when it can."""
        if self.devices is not None and device_type not in self.devices:
            return f"runs on {', '.join(self.devices)}, not {device_type}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"supports {', '.join(dtype_name(d) for d in self.dtypes)}, not {dtype_name(dtype)}"
        if self.requires is not None:
            return self.requires(device_type, dtype)
        return None


_IMPLS: dict[str, dict[str, Impl]] = {op: {} for op in OPS}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_op(op: str) -> None:
    if op not in OPS:
        raise UserError(f"unknown kernel op '{op}'{did_you_mean(op, OPS)}; ops: {', '.join(OPS)}")


def reference(op: str) -> Callable:
    """The op's pure-PyTorch reference implementation (the oracle every kernel is checked against)."""
    check_op(op)
    return OPS[op][0]


def _signature_of(fn: Callable) -> inspect.Signature:
    # A torch.library custom op is a CustomOpDef whose own signature is (*args, **kwargs).
    return inspect.signature(getattr(fn, "_init_fn", fn))


def signature(op: str) -> inspect.Signature:
    """The op's signature: every implementation takes these parameters (names, order, defaults)."""
    return _signature_of(reference(op))


def _params(sig: inspect.Signature) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in sig.parameters.values()]


def check_signature(op: str, fn: Callable, name: str) -> None:
    """Raise UserError unless fn's parameters (names, order, defaults) match the op's reference."""
    want = signature(op)
    try:
        got = _signature_of(fn)
    except (TypeError, ValueError):
        raise UserError(f"kernel '{name}' for op '{op}': cannot read its signature; "
                        f"it must be a Python function with parameters {want}") from None
    if _params(got) != _params(want):
        raise UserError(f"kernel '{name}' for op '{op}' has signature {got}; "
                        f"the op's signature is {want} (same names, order and defaults)")


def register(op: str, name: str, *, devices: Sequence[str] | None = None,
             dtypes: Sequence[torch.dtype] | None = None,
             requires: Callable[[str, torch.dtype], str | None] | None = None) -> Callable[[Callable], Callable]:
    """Decorator adding `fn` as implementation `name` of `op`.

    devices: device types it runs on (e.g. ("cuda",)); None = any. dtypes: compute dtypes it
    supports; None = any. requires(device_type, dtype) returns why it cannot run, or None.
    A second implementation with the same name for the same op, or a signature that differs
    from the op's reference, raises UserError.
    """
    check_op(op)
    if not name or not isinstance(name, str):
        raise UserError(f"kernel for op '{op}': name must be a non-empty string, got {name!r}")

    def decorate(fn: Callable) -> Callable:
        if name in _IMPLS[op]:
            prev = _IMPLS[op][name]
            raise UserError(f"kernel '{name}' for op '{op}' is already registered (by {prev.source}); "
                            f"pick another name")
        check_signature(op, fn, name)
        source = getattr(fn, "__module__", None) or "?"
        _IMPLS[op][name] = Impl(op, name, fn, tuple(devices) if devices is not None else None,
                                tuple(dtypes) if dtypes is not None else None, requires, source)
        return fn

    return decorate


def unregister(op: str, name: str) -> None:
    """Remove an implementation (for tests and interactive sessions)."""
    check_op(op)
    if name == REFERENCE:
        raise UserError("the reference implementation cannot be removed")
    _IMPLS[op].pop(name, None)


def implementations(op: str) -> dict[str, Impl]:
    """name -> Impl for `op`, the reference first."""
    check_op(op)
    return dict(_IMPLS[op])


def get(op: str, name: str) -> Impl:
    impls = implementations(op)
    if name not in impls:
        raise UserError(f"no implementation '{name}' for kernel op '{op}'{did_you_mean(name, impls)}; "
                        f"implementations: {', '.join(impls)}")
    return impls[name]


def resolve(op: str, name: str, device_type: str, dtype: torch.dtype, fallback: bool,
            where: str = "") -> Impl:
    """The implementation to run for an explicit choice `name` on this device and dtype.

    One that cannot run here is an error naming why, or, with fallback, the reference with a
    warning. `where` names the config key in messages.
    """
    impl = get(op, name)
    why = impl.unavailable(device_type, dtype)
    if why is None:
        return impl
    msg = f"kernel '{name}' for op '{op}'{f' ({where})' if where else ''} cannot run here: {why}"
    if not fallback:
        raise UserError(f"{msg}. Choose another implementation or set kernels.fallback = true "
                        f"to use the reference instead")
    log.warning("%s; using the reference (kernels.fallback = true)", msg)
    return get(op, REFERENCE)


for _op, (_ref, _) in OPS.items():
    register(_op, REFERENCE)(_ref)
