"""A model cut to the pipeline stages one rank runs (single-device code: pipeline parallelism
itself is titanite/parallel/pipeline_runner.py).

Both backends' forwards take a `Part` (which blocks to run, whether the embedding and the head are
in it). `keep_parts` removes from a meta-device model whatever none of a rank's parts runs. The
blocks it drops are replaced by `Elsewhere` placeholders, so the blocks that stay keep their
names (`layers.17...`): checkpoints and exports name the same tensors under every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Part:
    """The blocks one pipeline stage runs, and whether it starts with the embedding (first) and
    ends with the final norm and head (last)."""

    layers: range
    first: bool
    last: bool


class Elsewhere(nn.Module):
    """A block another pipeline stage holds; never called."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.index} runs on another pipeline stage")


def module_at(root: nn.Module, name: str) -> nn.Module | None:
    """The submodule at dotted `name`, or None where a cut left none (keep_parts)."""
    parent, _, attr = name.rpartition(".")
    return getattr(root.get_submodule(parent) if parent else root, attr)


def present(layers: nn.ModuleList) -> list[tuple[int, nn.Module]]:
    """(index, block) of the blocks this rank holds."""
    return [(i, b) for i, b in enumerate(layers) if not isinstance(b, Elsewhere)]


def keep_parts(root: nn.Module, layers_name: str, firsts: list[str], lasts: list[str], parts: list[Part]) -> None:
    """Drop from `root` the blocks (the nn.ModuleList at `layers_name`) and the first-stage
    modules (`firsts`: the embedding) and last-stage modules (`lasts`: the final norm and head)
    that none of `parts` runs. Dotted names; a dropped module becomes None (a block, Elsewhere)."""
    keep = {i for p in parts for i in p.layers}
    layers = root.get_submodule(layers_name)
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = Elsewhere(i)
    drop = ([] if any(p.first for p in parts) else list(firsts)) + ([] if any(p.last for p in parts) else list(lasts))
    for name in drop:
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, attr, None)
