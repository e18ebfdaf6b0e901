"""The estimate of a config's layout: memory per rank and FLOPs per step, before renting the
machines.

The parts are counted by titanite/plan/counts.py (parameters, gradients, optimizer,
activations, transients). They are not all alive at once: the peak is the largest of four
moments of a step, counted by titanite/plan/phases.py (`Estimate.phases`).
On CPU the trainer hands freed memory back when several ranks share the host
(titanite.device.memory.set_host_memory_policy), so the resident set follows these counts; a single
process keeps freed memory for speed, and its heap holds some fragmentation on top.

Qwen3.5 / Qwen3-Next (hybrid) layers are counted by titanite/plan/hybrid.py: Gated DeltaNet
blocks, gated attention, the shared expert; tensor parallelism and LoRA are not planned for them
yet (refused), nor context and pipeline parallelism (preflight refuses both for hybrid models).

A LoRA run (`[lora] enabled`) is counted by titanite/plan/lora.py: the frozen base in
lora.base_dtype with no gradients or optimizer state, fp32 adapters with both, and the adapters'
own activations and transients on top of the full fine-tune's; its peak is the same phases, with
no vocabulary gradients (the head and the embedding stay frozen).

A DPO run (`training.objective = "dpo"`) is counted by titanite/plan/preference.py: two
sequences per pair, the whole fp32 logits, and the reference (a second frozen copy, the base
with the adapters off, precomputed or none) with its no-grad forward as a moment of its own.

Under context parallelism (`parallelism.cp` > 1) each rank holds S / cp tokens of every
sequence: the per-token counts above are for that share, and titanite/plan/context.py counts
what CP adds (the gathered keys and values, their gradients, the shared attention mask) and the
bytes its collectives move per step (`Estimate.context`).

Under pipeline parallelism (`parallelism.pp` > 1) titanite/plan/pipeline_costs.py counts each pipeline
rank's stages: their states, the activations of the micro-batches the schedule keeps in flight
there, their moments; the estimate is the most loaded rank's, `Estimate.pipeline` holds every
rank's, the bubble and the point-to-point traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanite.core.config import Config, KernelsConfig
from titanite.core.errors import UserError
from titanite.device.choice import is_host, pick_device
from titanite.models.flops import flops_per_token
from titanite.models.handle import ActivationProfile
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.spec import get_spec
from titanite.parallel import pipeline_layout
from titanite.parallel.mesh import ParallelDims
from titanite.plan.context import ContextShare, add_context, context_share, local_tokens
from titanite.plan.counts import (
    Tensor,
    activation_bytes,
    fsdp_transient,
    layer_tensors,
    sharded,
    top_tensors,
    uses_fsdp,
)
from titanite.plan.hybrid import check_hybrid
from titanite.plan.lora import LoraParams, lora_memory
from titanite.plan.lora import flops_per_token as lora_flops
from titanite.plan.phases import accumulation_steps, step_phases
from titanite.plan.pipeline_costs import PipelineShare, counting_pass, pipeline_share
from titanite.plan.preference import (
    PreferenceShare,
    add_reference,
    is_preference,
    loss_terms,
    loss_values,
    preference_share,
    sequences_per_micro_batch,
)
from titanite.run.preflight import check_layout, choose_loss


@dataclass
class Estimate:
    dims: ParallelDims
    params: float
    grads: float
    optimizer: float
    activations: float  # kept at the end of forward
    recompute: float  # one block's activations rebuilt in backward (checkpointing only)
    transient: float
    flops_per_step: float  # per rank, training (forward + backward + recomputation)
    tokens_per_step: int  # global
    lora: LoraParams | None = None  # a LoRA run's parameter counts (params = its base + adapters)
    phases: dict[str, float] = field(default_factory=dict)  # the peak of each moment of a step
    preference: PreferenceShare | None = None  # a DPO run's reference (its bytes are in `phases`, not `params`)
    context: ContextShare | None = None  # context parallelism's buffers (in `phases`) and communication
    pipeline: PipelineShare | None = None  # every pipeline rank's share (the figures above: the most loaded's)

    @property
    def total(self) -> float:
        """The peak per rank: the largest phase."""
        return max(self.phases.values())

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def reference(self) -> float:
        """A DPO run's second frozen copy of the model, bytes per rank (0 without one)."""
        return self.preference.reference_bytes if self.preference is not None else 0.0


def estimate(cfg: Config, world_size: int, args: Qwen3Args | None = None,
             profile: ActivationProfile | None = None, on_gloo: bool | None = None,
             gloo_buffers: bool = True, device_memory: float | None = None) -> Estimate:
    """The estimate for `cfg` on `world_size` ranks. The config's model is built on the meta
    device and its layout checked as training checks it; `args` (another architecture, for
    what-if estimates) and `profile` override what that model says. `on_gloo`: whether the
    collectives run on gloo (CPU training; default: whether job.device resolves to the CPU here);
    `gloo_buffers`: then count the buffers gloo allocates outside torch's allocator too;
    `device_memory`: the bytes of one device planned for, which `kernels.loss = "auto"` is
    resolved against (default: this machine's job.device, as training resolves it)."""
    d = ParallelDims.resolve(cfg.parallelism, world_size)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    check_layout(d, handle)
    layout = pipeline_layout.check(cfg, d, handle, accumulation_steps(cfg, d))
    if layout is not None and args is not None and args is not handle.args:  # what-if: another architecture's split
        p = cfg.parallelism
        layout = pipeline_layout.resolve(d.pp, p.pp_schedule, p.pp_microbatches, list(p.pp_split), args,
                                         cfg.data.seq_len, accumulation_steps(cfg, d), p.pp_stages_per_rank)
    args = args or handle.args
    check_hybrid(args, d.tp)
    if args.is_hybrid and cfg.lora.enabled:
        raise UserError("the estimate does not count LoRA adapters on Qwen3.5 / Qwen3-Next (Gated DeltaNet) "
                        "layers yet; estimate the full fine-tune (lora.enabled = false)")
    if profile is None:
        profile = handle.activation_profile(_planned_loss(cfg, handle, device_memory), d.tp)
    dpo = is_preference(cfg)
    a, t = args, cfg.training
    layers = [layer_tensors(a, i, d.tp, d.ep) for i in range(a.num_layers)]
    top = top_tensors(a, d.tp)
    tokens = local_tokens(cfg, d, sequences_per_micro_batch(cfg))  # this rank's: S / cp of each sequence
    values = loss_values(cfg, a, d, profile.keeps_logits) if dpo else None
    if cfg.lora.enabled:
        memory, lora = lora_memory(cfg, a, d, layers, top, tokens, profile, values)
    else:
        memory, lora = _full_memory(cfg, a, d, layers, top, tokens, profile, values), None
    global_tokens = (t.global_batch_size or t.batch_size * d.dp) * cfg.data.seq_len * (2 if dpo else 1)
    if cfg.lora.enabled:
        per_token = lora_flops(a, cfg.lora, cfg.data.seq_len)
    else:
        per_token = flops_per_token(a, cfg.data.seq_len)
    flops = per_token * global_tokens / world_size
    base = flops
    if cfg.parallelism.activation_checkpoint == "full":
        flops += base / 3  # one more forward of the blocks (the head is not recomputed; a slight overcount)
    if a.num_experts and ((cfg.model.aux_loss_scope == "global_batch" and accumulation_steps(cfg, d) > 1)
                          or (layout is not None and counting_pass(a))):
        # the counting forward of every micro-batch (titanite/models/moe_balance.py, titanite/run/lm_step_pipelined.py)
        flops += base / 3
    if on_gloo is None:
        on_gloo = is_host(pick_device(cfg.job.device))
    block_grads = 0 if cfg.lora.enabled else max(sum(x.numel for x in layer) for layer in layers)  # LoRA's: small

    terms = loss_terms(cfg, a, d, top, tokens, profile.keeps_logits) if dpo else None
    phases = step_phases(cfg, a, d, top, tokens, profile.keeps_logits, memory, block_grads, on_gloo, gloo_buffers,
                         terms)
    cp = context_share(cfg, a, d, sequences_per_micro_batch(cfg), accumulation_steps(cfg, d), host=on_gloo)
    if layout is not None:  # the most loaded pipeline rank's figures (titanite/plan/pipeline_costs.py)
        pipe = pipeline_share(cfg, a, d, layout, tokens, profile, on_gloo, gloo_buffers, flops, cp)
        w = pipe.worst
        return Estimate(d, *w.memory, w.flops_per_step, global_tokens, lora=w.lora, phases=w.phases,
                        context=w.context, pipeline=pipe)
    phases = add_context(phases, cp)
    share = None
    if dpo:
        share = preference_share(cfg, a, d, layers, top, tokens, profile, world_size, global_tokens)
        params, grads, optimizer = memory[:3]
        before = params + optimizer + (grads if accumulation_steps(cfg, d) > 1 else 0.0)
        phases = add_reference(phases, share, before)
        flops += share.forward_flops_per_step
    return Estimate(d, *memory, flops, global_tokens, lora=lora, phases=phases, preference=share, context=cp)


def _planned_loss(cfg: Config, handle, device_memory: float | None) -> KernelsConfig:
    """`[kernels]` with `loss = "auto"` resolved as training resolves it (preflight.choose_loss),
    on the device planned for: `device_memory` bytes (a named accelerator's), else this machine's
    job.device."""
    return choose_loss(cfg, handle, pick_device(cfg.job.device), quiet=True, memory=device_memory)


def _full_memory(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]], top: list[Tensor],
                 tokens: int, profile: ActivationProfile, loss_values: float | None = None) -> list[float]:
    """[params, grads, optimizer, activations, recompute, transient] bytes per rank of a full fine-tune."""
    local = sharded([x for layer in layers for x in layer] + top, d)
    compute_bytes = 2 if cfg.training.mixed_precision == "bf16" else 4  # the copy FSDP gathers, the values
    unsharded = [sum(x.numel for x in layer) for layer in layers]
    transient = fsdp_transient(d, a, unsharded, top, unsharded, compute_bytes)
    if not uses_fsdp(d) and compute_bytes == 2:  # autocast's bf16 copies of the weights, kept for backward
        transient += 2.0 * local
    kept, recompute = activation_bytes(a, tokens, d.tp, cfg.parallelism.activation_checkpoint,
                                       profile.keeps_logits, compute_bytes, sp=profile.sequence_parallel,
                                       loss_values=loss_values)
    return [local * 4.0, local * 4.0, local * 8.0, kept, recompute, transient]
