"""Parallelising the transformers model from outside, with titanite's own pieces.

Data parallelism (FSDP2 / HSDP), activation checkpointing and torch.compile work on any module,
so they apply to transformers' decoder layers as they do to the native blocks: each decoder
layer is one FSDP group; a tied embedding/head matrix, which is one parameter, stays in the
root group with the final norm. Tensor parallelism uses the plan for transformers' Qwen3 module
names (titanite/parallel/hf_plan.py); expert parallelism is for the native model only.
"""

from __future__ import annotations

from torch import nn

from titanite.config import Config
from titanite.errors import UserError
from titanite.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from titanite.parallel.distributed import World
from titanite.parallel.fsdp import shard_model, uses_fsdp
from titanite.parallel.hf_plan import apply_tensor_parallel_hf


def parallelize_hf(model: nn.Module, world: World, cfg: Config) -> nn.Module:
    """Apply `cfg.parallelism` to a materialised HFCausalLM, in place; returns it."""
    p = cfg.parallelism
    for key in ("ep",):
        degree = getattr(world.dims, key) if world.dims is not None else 1
        if degree > 1:
            raise UserError(f"config key 'parallelism.{key}' = {degree} is not available with model.spec = 'hf' "
                            f"(titanite shards only its native model that way); use model.spec = 'qwen3' "
                            f"or set parallelism.{key} = 1")
    hf = model.hf
    if world.dims is not None and world.dims.tp > 1:  # dense only: ParallelDims.check_model refuses MoE
        apply_tensor_parallel_hf(hf, world.meshes["tp"], model.args.tie_word_embeddings)
    blocks = list(hf.model.layers)
    apply_activation_checkpointing(blocks, p.activation_checkpoint)
    if p.compile:
        apply_compile(blocks)
    if uses_fsdp(world):
        groups: list = blocks
        if not model.args.tie_word_embeddings:
            groups = [hf.model.embed_tokens, *blocks, [hf.model.norm, hf.lm_head]]
        # The transformers model is the FSDP root, not the wrapper: every forward (plain or
        # forward_train's `run`) enters through its __call__, where FSDP gathers the root group.
        shard_model(hf, groups, world, cfg.training.mixed_precision)
    return model
