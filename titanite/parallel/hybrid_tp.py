"""Tensor parallelism for the Gated DeltaNet layers of Qwen3.5 / Qwen3-Next, both backends.

Each rank runs Hk/tp whole key heads and the Hv/tp value heads they serve (a key head's value
heads are consecutive), so the recurrence, the conv and the gated norm never cross ranks:

- head-major parameters are sharded on dim 0 (Shard(0)): A_log and dt_bias [Hv]; transformers'
  in_proj_z / in_proj_b / in_proj_a (Qwen3.5) and in_proj_qkvz / in_proj_ba (Qwen3-Next, whose
  rows are grouped by key head) are column-parallel linears;
- the output projection is row-parallel, as attention's;
- the gated norm's weight [Dv] is replicated; its gradient is summed over the ranks, each of
  which saw only its own heads;
- block-ordered parameters, whose rows are q | k | v (| z) blocks one after another (the native
  w_qkvz, w_ba and conv weight; transformers' in_proj_qkv and conv1d), cannot be cut by one
  contiguous Shard(0) without giving a rank the wrong rows. They stay replicated DTensors; each
  rank multiplies by its own heads' rows of each block only (an index, not a collective), and
  the gradient, non-zero on each rank's rows only, is summed over the ranks. The result is exact
  and the compute is split; the memory of those parameters is not (a per-block placement would
  also need DCP and FSDP2 to understand it).

The layer's forward is the model's own, run on local views (`_local_views`), with its head
counts set to this rank's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from titanite.models.qwen3.hybrid import GatedDeltaNet


class _SumOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group: for a tensor
    every rank uses whole but only partly (its own heads' rows), so each rank's gradient is a
    partial sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def block_rows(blocks: list[int], rank: int, tp: int) -> torch.Tensor:
    """Row indices of this rank's slice of each block, for a tensor whose dim 0 is `blocks` one
    after another, each head-major: block b's rows [b*rank/tp, b*(rank+1)/tp), block by block."""
    out, start = [], 0
    for b in blocks:
        out.append(torch.arange(start + b // tp * rank, start + b // tp * (rank + 1)))
        start += b
    return torch.cat(out)


def _replicate(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    p = module._parameters[name]
    module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [placement]),
                                                 requires_grad=p.requires_grad))


class BlockRowsParallel(ParallelStyle):
    """A linear whose weight rows are head-major blocks one after another: the weight replicated,
    each rank computing its heads' rows of every block (see the module docstring). Input: the
    whole (replicated) activation, as a plain tensor; output: this rank's features, plain."""

    def __init__(self, blocks: list[int]) -> None:
        super().__init__()
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate(module, "weight", device_mesh, Replicate())
        rows = block_rows(self.blocks, device_mesh.get_local_rank(), device_mesh.size())
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = _SumOverTP.apply(module.weight.to_local(), group)
            # Only this rank's rows read x: its gradient is a partial sum too.
            return F.linear(_SumOverTP.apply(x, group), w.index_select(0, rows.to(w.device)))

        module.forward = forward
        return module


@contextlib.contextmanager
def _local_views(views: list[tuple[nn.Module, str, object]]) -> Iterator[None]:
    """Within the block, `module.<name>` reads as `view(parameter)`, a plain tensor that
    backpropagates into the DTensor parameter (an instance attribute shadows the registered
    parameter; FSDP's swaps in `_parameters` are not disturbed)."""
    for module, name, view in views:
        module.__dict__[name] = view(getattr(module, name))
    try:
        yield
    finally:
        for module, name, _ in views:
            del module.__dict__[name]


def _delta_parts(layer: nn.Module) -> dict:
    """The parts of a Gated DeltaNet layer (native or transformers'), by role."""
    if isinstance(layer, GatedDeltaNet):
        K, V, Hv = layer.key_heads * layer.key_dim, layer.value_heads * layer.value_dim, layer.value_heads
        return {"block_rows": {"w_qkvz": [K, K, V, V], "w_ba": [Hv, Hv]}, "colwise": [], "out": "wo",
                "conv": (layer, "conv_weight", [K, K, V]), "norm": layer.norm}
    K, V = layer.key_dim, layer.value_dim
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: rows grouped by key head
        block, colwise = {}, ["in_proj_qkvz", "in_proj_ba"]
    else:
        block, colwise = {"in_proj_qkv": [K, K, V]}, ["in_proj_z", "in_proj_b", "in_proj_a"]
    return {"block_rows": block, "colwise": colwise, "out": "out_proj", "conv": (layer.conv1d, "weight", [K, K, V]),
            "norm": layer.norm}


def _set_local_heads(layer: nn.Module, tp: int) -> None:
    """The layer's forward takes its widths from these attributes; make them this rank's."""
    if isinstance(layer, GatedDeltaNet):
        layer.splits = tuple(s // tp for s in layer.splits)
        layer.value_heads //= tp
        return
    for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
        if hasattr(layer, name):
            setattr(layer, name, getattr(layer, name) // tp)


def delta_out_name(block: nn.Module, mixer: str) -> str:
    """The output projection's path inside a decoder block whose token mixer is at `mixer`."""
    layer = block.get_submodule(mixer)
    return f"{mixer}.{'wo' if isinstance(layer, GatedDeltaNet) else 'out_proj'}"


def apply_delta_tp(layer: nn.Module, mesh: DeviceMesh, out_style: RowwiseParallel) -> None:
    """Shard one Gated DeltaNet layer (native or transformers') over the 1-D `mesh` in place.
    Its input: the whole sequence, a plain tensor, the same on every rank."""
    tp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    parts = _delta_parts(layer)
    plan: dict[str, ParallelStyle] = {name: BlockRowsParallel(b) for name, b in parts["block_rows"].items()}
    plan.update({name: ColwiseParallel() for name in parts["colwise"]})
    plan[parts["out"]] = out_style
    parallelize_module(layer, mesh, plan)
    conv_module, conv_name, conv_blocks = parts["conv"]
    conv_rows = block_rows(conv_blocks, rank, tp)
    _replicate(conv_module, conv_name, mesh, Replicate())
    _replicate(parts["norm"], "weight", mesh, Replicate())
    for name in ("A_log", "dt_bias"):
        _replicate(layer, name, mesh, Shard(0))

    def summed(p: DTensor) -> torch.Tensor:
        return _SumOverTP.apply(p.to_local(), group)

    def conv_view(p: DTensor) -> torch.Tensor:
        return summed(p).index_select(0, conv_rows.to(p.device))

    views = [(conv_module, conv_name, conv_view), (parts["norm"], "weight", summed),
             (layer, "A_log", DTensor.to_local), (layer, "dt_bias", DTensor.to_local)]
    _set_local_heads(layer, tp)
    forward = layer.forward

    def local_forward(*args, **kwargs):
        with _local_views(views):
            return forward(*args, **kwargs)

    layer.forward = local_forward
