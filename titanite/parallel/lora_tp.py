"""Tensor parallelism for LoRA-adapted linears (titanite's LoraLinear and peft's lora.Linear).

An adapted linear is cut like its base, and its factors so that the adapter's output has the
base output's layout without any extra collective:

- column-parallel base (W Shard(0), output sharded over features): A replicated, B Shard(0).
  Every rank computes the whole rank-r A x and its own slice of B A x.
- row-parallel base (W Shard(1), input sharded over features, output a partial sum): A Shard(1),
  B replicated. A x is then a partial sum over ranks too, and so is B A x; the base's own
  reduction (all-reduce or reduce-scatter to the sequence) sums both at once.

The styles are the stock ColwiseParallel / RowwiseParallel (same input and output handling)
with a partition function that knows the adapter's parts: its own `weight` (titanite) or
`base_layer` (peft) is the base; submodules under `lora_A` / `lora_B` are the factors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


@contextlib.contextmanager
def keep_frozen(module: nn.Module) -> Iterator[None]:
    """Parameters frozen before the block stay frozen after it: the stock styles (e.g.
    SequenceParallel) register their DTensor parameters with requires_grad=True, which would
    train a LoRA model's frozen norms."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    yield
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def has_adapter(module: nn.Module) -> bool:
    return any(name.startswith("lora_") for name, _ in module.named_children())


def _partition(base: Placement, a: Placement, b: Placement):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        weight = module._parameters.get("weight")
        if weight is None:
            return
        parts = name.split(".")
        placement = a if "lora_A" in parts else b if "lora_B" in parts else base
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight.data, mesh, [placement]),
                                                         requires_grad=weight.requires_grad))

    return partition


class LoraColwiseParallel(ColwiseParallel):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _partition(Shard(0), Replicate(), Shard(0)),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class LoraRowwiseParallel(RowwiseParallel):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for a linear
        return distribute_module(module, device_mesh, _partition(Shard(1), Shard(1), Replicate()),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def adapt_plan(plan: dict[str, ParallelStyle], root: nn.Module) -> dict[str, ParallelStyle]:
    """The plan for `root` with each column/row-parallel style whose module carries an adapter
    replaced by its LoRA twin (same layouts)."""
    out = {}
    for path, style in plan.items():
        module = root.get_submodule(path)
        if has_adapter(module) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            twin = copy.copy(style)
            twin.__class__ = LoraColwiseParallel if isinstance(style, ColwiseParallel) else LoraRowwiseParallel
            style = twin
        out[path] = style
    return out
