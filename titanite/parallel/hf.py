"""The parallel plan for the transformers backend (`model.spec = "hf"`): FSDP2 / HSDP,
activation checkpointing, compile, and a tensor-parallel plan for transformers' Qwen3 modules.

Data parallelism, checkpointing and compile work on any module, so they apply to transformers'
decoder layers as they do to the native blocks: each decoder layer is one FSDP group; a tied
embedding/head matrix, which is one parameter, stays in the root group with the final norm.

Expert parallelism (MoE) is the native model's code (expert_parallel.py), entered through the
experts interface titanite installs in transformers' experts modules.

Tensor parallel (DTensor):

The same cut as the native plan (tensor_parallel.py): q/k/v and gate/up column-parallel, o and
down row-parallel, the embedding and the head sharded over the vocabulary with a
vocabulary-parallel loss, per-head q/k norms treated as sequence parallel over the head dim.
The residual stream between layers stays whole on every rank (no sequence parallelism):
transformers builds the attention mask and positions from the embedding output's length, which
a sequence-sharded embedding would cut short. The other norms therefore see identical inputs
on every rank; their weights are replicated DTensors so that every parameter lives on the mesh.
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

from titanite.core.config import Config
from titanite.models.handle import ModelHandle
from titanite.models.stage import module_at, present
from titanite.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from titanite.parallel.distributed import World
from titanite.parallel.fsdp import fsdp_groups, shard_model, uses_fsdp
from titanite.parallel.lora_tp import adapt_plan, keep_frozen


def parallelize_hf(handle: ModelHandle, world: World, cfg: Config) -> None:
    """Apply `cfg.parallelism` to a materialised transformers model (an HFModel's module), in place."""
    p, model = cfg.parallelism, handle.module
    hf = model.hf
    tied = handle.args.tie_word_embeddings
    if world.dims is not None and world.dims.tp > 1:
        with keep_frozen(hf):
            apply_tensor_parallel_hf(hf, world.meshes["tp"], tied)
        handle.vocab_parallel = True
    expert_params: list = []
    if world.dims is not None and world.dims.ep > 1:
        from titanite.parallel.expert_parallel import apply_expert_parallel_hf

        expert_params = [p for m in apply_expert_parallel_hf(hf, world.meshes["ep"]) for p in m.parameters()]
    blocks = [b for _, b in present(hf.model.layers)]
    apply_activation_checkpointing(blocks, p.activation_checkpoint)
    if p.compile:
        apply_compile(blocks, world.device)
    if uses_fsdp(world):
        groups: list = blocks if tied else fsdp_groups(hf.model.embed_tokens, blocks, [hf.model.norm, hf.lm_head])
        # The transformers model is the FSDP root, not the wrapper: every forward (plain or
        # forward_train's `run`) enters through its __call__, where FSDP gathers the root group.
        # A pipeline stage runs its part through the wrapper's call instead, so there the
        # wrapper is the root.
        root = model if handle.stage_parts is not None else hf
        shard_model(root, groups, world, cfg.training.mixed_precision, expert_params)


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the mesh; plain full inputs in, plain full outputs out."""

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


def _layer_plan(sparse: bool) -> dict:
    """One decoder layer's plan. A sparse (MoE) layer's block is left whole: it runs on every
    tensor-parallel rank on the same tokens (the residual stream is whole here), its experts
    sharded by expert parallelism when ep > 1."""
    plan = {
        "input_layernorm": ReplicateParallel(),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),  # [B, S, Hq/tp, D]
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.o_proj": RowwiseParallel(),
        "post_attention_layernorm": ReplicateParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    return {k: v for k, v in plan.items() if not (sparse and k.startswith("mlp."))}


def apply_tensor_parallel_hf(causal_lm: nn.Module, tp_mesh: DeviceMesh, tied: bool) -> None:
    """Shard a materialised transformers Qwen3ForCausalLM (dense) in place over `tp_mesh`.
    The logits come out as a DTensor sharded over the vocabulary (for `loss_parallel`)."""
    top = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.norm": ReplicateParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    present_top = {k: v for k, v in top.items() if module_at(causal_lm, k) is not None}  # a pipeline stage's own modules
    parallelize_module(causal_lm, tp_mesh, present_top)
    for _, layer in present(causal_lm.model.layers):
        parallelize_module(layer, tp_mesh, adapt_plan(_layer_plan(sparse=hasattr(layer.mlp, "experts")), layer))
    if tied:
        # Each style registered its own Parameter; the head must use the embedding's (both are
        # vocabulary-sharded [V, H], so one DTensor serves both).
        causal_lm.lm_head.weight = causal_lm.model.embed_tokens.weight
