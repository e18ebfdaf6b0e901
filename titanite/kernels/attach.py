"""Binding modules' kernel call sites to implementations, from the `[kernels]` table.

A module holds a `Kernel` per op it calls (`self.kernel = kernels.op("rms_norm")`). `attach`
walks a built model once, before it is parallelised or compiled, and binds every call site:

1. an FQN glob key in `[kernels]` that matches the call site (`layers.3.feed_forward.swiglu`) or
   its module (`layers.3.feed_forward`), when the site's op has that implementation; the last
   such key in the table wins;
2. else the op's name as a key (`"moe.experts" = "triton"`);
3. else the op's default: the first of its preferred implementations that runs on this device
   and dtype.

An explicit choice that cannot run here is an error, or the reference with a warning when
`kernels.fallback` is true. Each binding is logged once.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

import titanite.kernels.registry as registry
from titanite.core.errors import UserError

log = logging.getLogger("titanite")

# An op's defaults, best first; the last entry must run everywhere (pure PyTorch).
DEFAULTS: dict[str, tuple[str, ...]] = {
    "attention": ("sdpa", registry.REFERENCE),
    "rms_norm": (registry.REFERENCE,),
    "rope": (registry.REFERENCE,),
    "swiglu": (registry.REFERENCE,),
    "moe.router": (registry.REFERENCE,),
    "moe.dispatch": ("gather", registry.REFERENCE),
    "moe.experts": ("grouped_mm", registry.REFERENCE),
    "loss": ("chunked", registry.REFERENCE),
    "gated_delta": (registry.REFERENCE,),
    "short_conv": (registry.REFERENCE,),
    "rms_norm_gated": (registry.REFERENCE,),
}
assert set(DEFAULTS) == set(registry.OPS)


class Kernel:
    """A module's call site for one op. Until `attach` binds it, it runs the op's default for
    the device and dtype of its first tensor argument."""

    def __init__(self, op: str) -> None:
        registry.check_op(op)
        self.op = op
        self.impl: registry.Impl | None = None
        self.fn: Callable | None = None

    def bind(self, impl: registry.Impl) -> None:
        assert impl.op == self.op, (impl.op, self.op)
        self.impl, self.fn = impl, impl.fn

    def __call__(self, *args, **kwargs):
        if self.fn is not None:
            return self.fn(*args, **kwargs)
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return default_impl(self.op, first.device.type, first.dtype).fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Kernel({self.op!r} -> {self.impl.name if self.impl else 'default'})"


def default_impl(op: str, device_type: str, dtype: torch.dtype) -> registry.Impl:
    impls = registry.implementations(op)
    for name in DEFAULTS[op]:
        if name in impls and impls[name].unavailable(device_type, dtype) is None:
            return impls[name]
    return impls[registry.REFERENCE]


def iter_kernels(model: nn.Module) -> Iterator[tuple[str, str, Kernel]]:
    """(call-site FQN, module FQN, Kernel) for every kernel call site in the model."""
    for module_fqn, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Kernel):
                yield (f"{module_fqn}.{attr}" if module_fqn else attr), module_fqn, value


def _matches(glob: str, site: str, module_fqn: str) -> bool:
    return fnmatch.fnmatchcase(site, glob) or (bool(module_fqn) and fnmatch.fnmatchcase(module_fqn, glob))


def attach(model: nn.Module, select: dict[str, str], device_type: str, dtype: torch.dtype,
           fallback: bool = False, alias: Callable[[str], str] | None = None) -> dict[str, str]:
    """Bind every kernel call site of `model`; returns {call-site FQN: "op:implementation"}.

    select: the `[kernels]` table's op / FQN-glob keys -> implementation names. dtype: the
    compute dtype (bf16 under bf16 autocast). alias: a second name for each site and module
    FQN that globs also match (the transformers backend gives the native model's names, so a
    glob written for either model selects the same places in both). Raises UserError for an
    unknown op or implementation, a glob that binds nothing, or (without fallback) a choice
    that cannot run.
    """
    sites = list(iter_kernels(model))
    if alias is not None:
        names = {s: (alias(s), alias(m)) for s, m, _ in sites}
        plain = _matches

        def _matches_either(glob: str, site: str, module_fqn: str) -> bool:
            return plain(glob, site, module_fqn) or plain(glob, *names[site])

        matches = _matches_either
    else:
        matches = _matches
    op_keys = {k: v for k, v in select.items() if k in registry.OPS}
    globs = {k: v for k, v in select.items() if k not in registry.OPS}
    for op, name in op_keys.items():
        registry.get(op, name)  # unknown names fail even when no module uses the op
    glob_hits: dict[str, int] = {g: 0 for g in globs}
    resolved: dict[tuple[str, str], registry.Impl] = {}
    bound: dict[str, str] = {}
    for site, module_fqn, kernel in sites:
        key = None
        for glob, name in globs.items():
            if matches(glob, site, module_fqn) and name in registry.implementations(kernel.op):
                key = glob
                glob_hits[glob] += 1
        if key is None and kernel.op in op_keys:
            key = kernel.op
        if key is None:
            impl = default_impl(kernel.op, device_type, dtype)
        else:
            name = select[key]
            if (kernel.op, name) not in resolved:
                resolved[kernel.op, name] = registry.resolve(kernel.op, name, device_type, dtype, fallback,
                                                             where=f"[kernels] \"{key}\" = \"{name}\"")
            impl = resolved[kernel.op, name]
        kernel.bind(impl)
        bound[site] = f"{kernel.op}:{impl.name}"
    for glob, hits in glob_hits.items():
        if not hits:
            _unused_glob(glob, globs[glob], sites, matches)
    _log_bindings(bound)
    return bound


def _unused_glob(glob: str, name: str, sites: list[tuple[str, str, Kernel]], matches: Callable) -> None:
    matched = [(s, k.op) for s, m, k in sites if matches(glob, s, m)]
    ops = ", ".join(registry.OPS)
    if not matched:
        examples = ", ".join(s for s, _, _ in sites[:6])
        raise UserError(f"[kernels] key \"{glob}\" is neither an op ({ops}) nor a glob matching a module of "
                        f"this model; module kernel sites look like: {examples}")
    matched_ops = sorted({op for _, op in matched})
    have = {op: ", ".join(registry.implementations(op)) for op in matched_ops}
    raise UserError(f"[kernels] \"{glob}\" = \"{name}\": no op of the matched modules has an implementation "
                    f"'{name}'; " + "; ".join(f"{op}: {impls}" for op, impls in have.items()))


_LAYER_INDEX = re.compile(r"(?<=layers\.)(\d+)(?=\.)")


def _compress(sites: list[str]) -> str:
    """layers.0.x, layers.1.x, layers.2.x -> layers.[0-2].x (short log lines for deep models)."""
    groups: dict[str, list[int]] = {}
    for s in sites:
        m = _LAYER_INDEX.search(s)
        pattern = _LAYER_INDEX.sub("{}", s, count=1) if m else s
        groups.setdefault(pattern, []).append(int(m.group(1)) if m else -1)
    out = []
    for pattern, idx in groups.items():
        if idx == [-1]:
            out.append(pattern)
            continue
        ranges, start, prev = [], idx[0], idx[0]
        for i in idx[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        out.append(pattern.replace("{}", f"[{','.join(ranges)}]" if len(idx) > 1 else str(idx[0])))
    return ", ".join(out)


def _log_bindings(bound: dict[str, str]) -> None:
    by_impl: dict[str, list[str]] = {}
    for site, op_impl in bound.items():
        by_impl.setdefault(op_impl, []).append(site)
    for op_impl, sites in sorted(by_impl.items()):
        log.info("kernel %s: %s", op_impl, _compress(sites))
