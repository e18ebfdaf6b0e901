"""Parallelising the native Qwen3 (dense and MoE): the order the pieces are applied in.

Tensor parallel, then expert parallel (both turn parameters into DTensors), then activation
checkpointing and compile per block, then FSDP on top: each block is one FSDP group; the
embeddings, final norm and head are grouped so that a tied embedding/head matrix is one
parameter in one group.
"""

from __future__ import annotations

from titanite.core.config import Config
from titanite.models.handle import ModelHandle
from titanite.models.stage import present
from titanite.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from titanite.parallel.distributed import World
from titanite.parallel.fsdp import fsdp_groups, shard_model, uses_fsdp
from titanite.parallel.lora_tp import keep_frozen
from titanite.parallel.tensor_parallel import apply_tensor_parallel_qwen3, replicate_unsplit


def parallelize_qwen3(handle: ModelHandle, world: World, cfg: Config) -> None:
    """Apply `cfg.parallelism` to a materialised native Qwen3 (a Qwen3Model's module), in place."""
    p, model = cfg.parallelism, handle.module
    dims = world.dims
    if dims is not None and dims.tp > 1:
        with keep_frozen(model):
            apply_tensor_parallel_qwen3(model, world.meshes["tp"])
            if not uses_fsdp(world):  # FSDP would turn the MoE blocks' plain parameters into DTensors
                replicate_unsplit([b.feed_forward for _, b in present(model.layers)
                                   if hasattr(b.feed_forward, "experts")], world.meshes["tp"])
        # The fused head + loss op takes a whole [V, H] head; with a vocabulary-sharded head the
        # model returns sharded logits and the trainer's cross-entropy runs under loss_parallel.
        handle.vocab_parallel = True
    expert_params: list = []
    if dims is not None and dims.ep > 1:
        from titanite.parallel.expert_parallel import apply_expert_parallel_qwen3

        expert_params = [p for m in apply_expert_parallel_qwen3(model, world.meshes["ep"]) for p in m.parameters()]
    blocks = [b for _, b in present(model.layers)]
    apply_activation_checkpointing(blocks, p.activation_checkpoint)
    if p.compile:
        apply_compile(blocks, world.device)
    if uses_fsdp(world):
        groups: list = blocks
        if model.output is not None:
            # Untied: the embedding and the head are separate groups; the root keeps nothing.
            groups = fsdp_groups(model.tok_embeddings, blocks, [model.norm, model.output])
        # Tied: the shared matrix, the embedding and the head stay in the root group.
        shard_model(model, groups, world, cfg.training.mixed_precision, expert_params)
