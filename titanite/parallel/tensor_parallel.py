"""Tensor-parallel plans (DTensor) for the native Qwen3, with sequence parallel norms and a
vocabulary-parallel head. A decoder block's plan (`block_plan`) is shared with the transformers
backend (hf.py), which names the same roles differently and keeps the residual stream whole.

Inside a block: q/k/v and gate/up projections are column-parallel (each rank holds whole heads
and a slice of the MLP), o and down projections row-parallel. Between blocks the residual
stream is sharded over the sequence (sequence parallel), so the RMSNorms run on S/tp tokens; it
is all-gathered before attention and the MLP and reduce-scattered after them. The embedding is
sharded over the vocabulary, and so are the logits: the cross-entropy runs across the shards
(`loss_parallel`), never gathering the [B, S, V] logits.

The per-head q/k norms see this rank's heads only: they are treated as sequence parallel over
the head dimension, so their (replicated) weights get gradients summed over all heads.

An MoE block is not split: it gets the whole gathered sequence on every tensor-parallel rank,
computes the same output there (its experts sharded by expert parallelism when ep > 1), and
each rank keeps its sequence slice of the output. Its backward all-gathers the output gradient,
so every rank computes the same, complete gradients for the router and the experts (no sum over
the tensor-parallel ranks is needed). The price is that the MoE layers' work is repeated on each
of the tp ranks; attention and dense MLPs are split as above.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanite.models.qwen3.hybrid import GatedDeltaNet
from titanite.models.stage import present
from titanite.parallel.hybrid_tp import apply_delta_tp
from titanite.parallel.lora_tp import adapt_plan

# A decoder block's modules by role: the native model's names (the transformers backend's are in hf.py).
NATIVE_NAMES = {
    "attention_norm": "attention_norm", "q": "attention.wq", "k": "attention.wk", "v": "attention.wv",
    "q_norm": "attention.q_norm", "k_norm": "attention.k_norm", "o": "attention.wo",
    "mlp_norm": "ffn_norm", "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2",
}


def _gather_sequence(mesh: DeviceMesh):
    """Forward pre-hook: the module's first input arrives sequence-sharded [B, S/tp, H] and is
    all-gathered to [B, S, H] (a plain tensor); other inputs (RoPE tables, document ids) pass."""

    def hook(_module: nn.Module, args: tuple):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(placements=[Replicate()]).to_local(), *args[1:])

    return hook


def _keep_sequence_slice(mesh: DeviceMesh):
    """Forward hook of an unsplit (MoE) block: its whole-sequence output [B, S, H], the same on
    every rank, becomes this rank's slice [B, S/tp, H] of the residual stream; backward gathers
    the slices' gradients into the whole output's."""

    def hook(_module: nn.Module, _args, output):
        whole = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
        return whole.redistribute(placements=[Shard(1)]).to_local()

    return hook


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the mesh; plain full inputs in, plain full outputs out. The norms'
    style where the residual stream is whole (no sequence parallelism), so that every parameter
    still lives on the mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name, mod, mesh):
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]),
                                                          requires_grad=p.requires_grad))

        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if hasattr(a, "shape") and not isinstance(a, DTensor) else a for a in args)

        def outputs(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def block_plan(names: dict[str, str], sequence_parallel: bool, sparse: bool, delta: bool = False
               ) -> dict[str, ParallelStyle]:
    """One decoder block's plan, keyed by the module names `names` gives each role.

    sequence_parallel: the residual stream between blocks is sharded over the sequence, so the
    norms run on S/tp tokens and the row-parallel outputs are reduce-scattered back to that
    shard; without it the stream is whole and the norms' weights are merely replicated.
    sparse: an MoE block's MLP gets no entries: it runs unsplit on every tensor-parallel rank.
    delta: the token mixer is a Gated DeltaNet (Qwen3.5 / Qwen3-Next), sharded by
    hybrid_tp.apply_delta_tp instead: no q/k/v/o entries."""
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    row_out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {
        names["attention_norm"]: norm(),
        names["q"]: ColwiseParallel(),
        names["k"]: ColwiseParallel(),
        names["v"]: ColwiseParallel(),
        names["q_norm"]: SequenceParallel(sequence_dim=2, use_local_output=True),  # [B, S, Hq/tp, D]
        names["k_norm"]: SequenceParallel(sequence_dim=2, use_local_output=True),
        names["o"]: RowwiseParallel(**row_out),
        names["mlp_norm"]: norm(),
    }
    if delta:
        plan = {k: v for k, v in plan.items() if k in (names["attention_norm"], names["mlp_norm"])}
    if not sparse:
        plan.update({names["gate"]: ColwiseParallel(), names["up"]: ColwiseParallel(),
                     names["down"]: RowwiseParallel(**row_out)})
    return plan


def _replicate_output(_module: nn.Module, _inputs, output):
    # The tied head multiplies the final hidden states by the vocab-sharded embedding matrix;
    # that needs every token on every rank.
    return output.redistribute(placements=[Replicate()])


def apply_tensor_parallel_qwen3(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a materialised native Qwen3 (dense or MoE) in place over the 1-D `tp_mesh`."""
    top = {
        # Rows of the embedding are vocabulary ids; the output is reduce-scattered to the
        # sequence-sharded residual stream.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    top = {k: v for k, v in top.items() if getattr(model, k) is not None}  # a pipeline stage's own modules
    parallelize_module(model, tp_mesh, top)
    if model.output is None and model.norm is not None:
        model.norm.register_forward_hook(_replicate_output)
    for _, block in present(model.layers):
        sparse = hasattr(block.feed_forward, "experts")
        delta = isinstance(block.attention, GatedDeltaNet)
        plan = block_plan(NATIVE_NAMES, sequence_parallel=True, sparse=sparse, delta=delta)
        parallelize_module(block, tp_mesh, adapt_plan(plan, block))
        if delta:
            apply_delta_tp(block.attention, tp_mesh, RowwiseParallel(output_layouts=Shard(1)))
        block.attention.register_forward_pre_hook(_gather_sequence(tp_mesh))
        block.feed_forward.register_forward_pre_hook(_gather_sequence(tp_mesh))
        if sparse:
            block.feed_forward.register_forward_hook(_keep_sequence_slice(tp_mesh))


def replicate_unsplit(modules: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Without FSDP (tensor parallelism alone), the parameters of the unsplit MoE blocks would stay
    plain tensors beside the DTensors of the rest, which the optimizer's foreach/fused kernels
    refuse to mix: make them replicated DTensors on the tensor-parallel mesh. Each module's
    forward reads them as plain local tensors; their gradients are already complete and equal on
    every rank (see the module docstring), so nothing is summed."""
    for module in modules:
        owners = []
        for name, p in list(module.named_parameters()):
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            if not isinstance(p, DTensor):
                owner.register_parameter(leaf, nn.Parameter(distribute_tensor(p.data, tp_mesh, [Replicate()]),
                                                            requires_grad=p.requires_grad))
            owners.append((owner, leaf))
        module.forward = _with_local_parameters(module.forward, owners)


def _with_local_parameters(forward, owners: list[tuple[nn.Module, str]]):
    def local_forward(*args, **kwargs):
        for owner, leaf in owners:  # an instance attribute shadows the registered parameter
            owner.__dict__[leaf] = getattr(owner, leaf).to_local()
        try:
            return forward(*args, **kwargs)
        finally:
            for owner, leaf in owners:
                del owner.__dict__[leaf]

    return local_forward
