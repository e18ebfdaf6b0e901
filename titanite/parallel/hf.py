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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titanite.core.config import Config
from titanite.models.handle import ModelHandle
from titanite.models.stage import module_at, present
from titanite.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from titanite.parallel.distributed import World
from titanite.parallel.fsdp import fsdp_groups, shard_model, uses_fsdp
from titanite.parallel.hybrid_tp import apply_delta_tp
from titanite.parallel.lora_tp import adapt_plan, keep_frozen
from titanite.parallel.tensor_parallel import ReplicateParallel, block_plan, replicate_unsplit

# transformers' Qwen3 decoder layer's modules by role (see tensor_parallel.block_plan).
HF_NAMES = {
    "attention_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
    "v": "self_attn.v_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
    "up": "mlp.up_proj", "down": "mlp.down_proj",
}


def parallelize_hf(handle: ModelHandle, world: World, cfg: Config) -> None:
    """Apply `cfg.parallelism` to a materialised transformers model (an HFModel's module), in place."""
    p, model = cfg.parallelism, handle.module
    hf = model.hf
    tied = handle.args.tie_word_embeddings
    if world.dims is not None and world.dims.tp > 1:
        with keep_frozen(hf):
            apply_tensor_parallel_hf(hf, world.meshes["tp"], tied)
            if not uses_fsdp(world):  # FSDP would turn the MoE blocks' plain parameters into DTensors
                replicate_unsplit([layer.mlp for _, layer in present(hf.model.layers)
                                   if hasattr(layer.mlp, "experts")], world.meshes["tp"])
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
        # A sparse (MoE) layer's block is left whole: it runs on every tensor-parallel rank on the
        # same tokens (the residual stream is whole here), its experts sharded by expert
        # parallelism when ep > 1.
        delta = hasattr(layer, "linear_attn")  # Qwen3.5 / Qwen3-Next: a Gated DeltaNet layer
        plan = block_plan(HF_NAMES, sequence_parallel=False, sparse=hasattr(layer.mlp, "experts"), delta=delta)
        parallelize_module(layer, tp_mesh, adapt_plan(plan, layer))
        if delta:
            apply_delta_tp(layer.linear_attn, tp_mesh, RowwiseParallel())
    if tied:
        # Each style registered its own Parameter; the head must use the embedding's (both are
        # vocabulary-sharded [V, H], so one DTensor serves both).
        causal_lm.lm_head.weight = causal_lm.model.embed_tokens.weight
