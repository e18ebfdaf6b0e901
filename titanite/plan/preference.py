"""Preference tuning's share of `titanite estimate` (`training.objective = "dpo"`);
titanite/plan/counts.py, lora.py and estimator.py count the rest.

A DPO micro-batch of `training.batch_size` pairs is 2 x batch_size sequences (the chosen rows,
then the rejected ones), each padded to data.seq_len, so the policy's activations are those of
2 x batch_size sequences. The loss needs every sequence's summed log-probabilities, computed
from the whole fp32 logits of the micro-batch [2B, S, V] (there is no chunked loss for DPO), so
the loss is counted as the reference (logits-keeping) loss: the logits and their log-softmax
kept until backward, three fp32 [2B x S, V] at the loss's backward (titanite/plan/phases.py).

The reference policy, as titanite/preference/reference.py holds it (preference.reference and
loss_type):
- 'model', no LoRA (or LoRA with preference.reference_path): a second frozen model on every
  rank, sharded as the policy (FSDP2/HSDP, TP, EP), stored in the policy's parameter dtype
  (fp32: bf16 training is autocast over fp32 weights), with no gradients and no optimizer state:
  its parameters are alive in every moment of the step. Under FSDP with tied embeddings its root
  group (the embedding) also stays gathered, in the compute dtype, after its first forward: FSDP2
  does not reshard a root after forward, and no backward of the reference ever does;
- 'model' with LoRA and no reference_path: the base with the adapters switched off. No second
  copy; only the extra no-grad forward;
- 'precomputed': log-probabilities computed once before training, read with the data (two
  floats per pair): nothing during training (the pass before it holds the reference model
  without the policy's optimizer state or activations, less than a training step);
- 'none', or a reference-free loss ('simpo'): no reference at all.

The reference's no-grad forward keeps nothing for backward: at its peak it holds one block's
working values (counted as the values that block would keep for backward without
checkpointing, counts.layer_activation_elems), its logits [2B x S, V / tp] in the compute dtype
with their fp32 copy and the fp32 log-softmax inside the cross-entropy
(reference.sequence_logps), and, under FSDP, its gathered copies: the biggest block, current
and prefetched, and, untied, the head's group. It is counted as a moment of its own ("reference
forward"), conservatively with the policy's forward already done: its kept activations and what
stays gathered or cast with them (FSDP2's root group; without FSDP, autocast's 16-bit copies of
the weights) alive beside it, as when the reference runs after the policy's forward (TRL's
order). Run before it, that moment holds less.

FLOPs: the policy's training FLOPs for 2 x batch_size sequences per micro-batch, plus one
forward (a third of the full training FLOPs per token, titanite.models.flops) of the reference
over the same tokens when it is live.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanite.config import Config
from titanite.models.flops import flops_per_token
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims
from titanite.plan.counts import Tensor, layer_activation_elems, sharded
from titanite.preference.reference import adapters_are_reference, uses_reference

# the reference as the estimate counts it -> what the report calls it
KINDS = {"model": "a second frozen copy of the model",
         "adapters off": "the base with the adapters switched off (LoRA): no second copy",
         "precomputed": "precomputed log-probabilities, read with the data: no memory while training",
         "none": "none (a reference-free loss)"}


@dataclass(frozen=True)
class PreferenceShare:
    """What the estimate counted for a DPO run's reference (bytes per rank)."""

    kind: str  # one of KINDS
    sequences: int  # per micro-batch: 2 x training.batch_size
    params_bytes: float  # the second copy's parameters, fp32, sharded (0 unless kind == 'model')
    held_bytes: float  # its root group, kept gathered after its forward (FSDP, tied embeddings)
    forward_bytes: float  # its no-grad forward at the peak (transient; 0 without a live reference)
    forward_flops_per_step: float  # per rank, the reference's forwards (included in Estimate.flops_per_step)

    @property
    def reference_bytes(self) -> float:
        """What the reference holds in every moment of the step."""
        return self.params_bytes + self.held_bytes

    @property
    def live(self) -> bool:
        """A reference forward runs in the step (a second copy, or the base with adapters off)."""
        return self.kind in ("model", "adapters off")

    def describe(self) -> str:
        return KINDS[self.kind]


def is_preference(cfg: Config) -> bool:
    return cfg.training.objective == "dpo"


def reference_kind(cfg: Config) -> str:
    """The reference a DPO config trains with (titanite/preference/reference.py decides): 'model',
    'adapters off', 'precomputed' or 'none'."""
    if not uses_reference(cfg):
        return "none"
    if cfg.preference.reference == "precomputed":
        return "precomputed"
    return "adapters off" if adapters_are_reference(cfg) else "model"


def sequences_per_micro_batch(cfg: Config) -> int:
    """Sequences of data.seq_len tokens in one micro-batch: a DPO pair is two."""
    return cfg.training.batch_size * (2 if is_preference(cfg) else 1)


def _compute_bytes(cfg: Config) -> int:
    return 2 if cfg.training.mixed_precision == "bf16" else 4


def _root(a: Qwen3Args, d: ParallelDims, top: list[Tensor], c: int) -> float:
    """FSDP's root group as it stays gathered after forward (tied embeddings: the embedding; untied,
    the root holds only the final norm), in the compute dtype; 0 without FSDP."""
    return sum(x.numel for x in top) * c if d.dp > 1 and a.tie_word_embeddings else 0.0


def reference_forward_bytes(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]],
                            top: list[Tensor], tokens: int, sp: bool) -> float:
    """Bytes per rank the reference's no-grad forward adds at its peak (the module docstring):
    one block's working values, its logits with their fp32 copy and log-softmax, and, under
    FSDP, its gathered copies in the compute dtype: the biggest block twice (current,
    prefetched) and, untied, the head's group (tied, the root group is held all step)."""
    c = _compute_bytes(cfg)
    block = max(layer_activation_elems(a, i, d.tp, "none", sp) for i in range(a.num_layers)) * tokens * c
    logits = tokens * top[0].rows * (c + 4 + (4 if c != 4 else 0))  # compute dtype, fp32 copy, log-softmax
    gathered = 0.0
    if d.dp > 1:
        gathered = 2 * max(sum(x.numel for x in layer) for layer in layers) * c
        gathered += 0.0 if a.tie_word_embeddings else top[0].numel * c  # the head's group, for the logits
    return block + logits + gathered


def policy_held(cfg: Config, a: Qwen3Args, d: ParallelDims, top: list[Tensor], transient: float) -> float:
    """What the policy keeps gathered or cast after its forward, beside its kept activations:
    without FSDP, its transients (autocast's 16-bit copies of the weights; none in fp32); under
    FSDP its root group."""
    return transient if d.dp == 1 else _root(a, d, top, _compute_bytes(cfg))


def preference_share(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]], top: list[Tensor],
                     tokens: int, sp: bool, world_size: int, global_tokens: int) -> PreferenceShare:
    """The reference's bytes and FLOPs for a DPO config. `layers`, `top`: the model's tensors as a
    rank holds them before FSDP; `tokens`: one micro-batch's (both sequences of each pair);
    `global_tokens`: one optimizer step's over all ranks."""
    kind = reference_kind(cfg)
    params = held = forward = flops = 0.0
    if kind == "model":
        params = sharded([x for layer in layers for x in layer] + top, d) * 4.0
        held = _root(a, d, top, _compute_bytes(cfg))
    if kind in ("model", "adapters off"):
        forward = reference_forward_bytes(cfg, a, d, layers, top, tokens, sp)
        flops = flops_per_token(a, cfg.data.seq_len) / 3 * global_tokens / world_size
    return PreferenceShare(kind, sequences_per_micro_batch(cfg), params, held, forward, flops)


def add_reference(phases: dict[str, float], share: PreferenceShare, forward_moment: float) -> dict[str, float]:
    """The step's moments with the reference: what it holds in each, and its forward first
    (`forward_moment`: what the policy holds then, the module docstring)."""
    out = {"reference forward": forward_moment + share.reference_bytes + share.forward_bytes} if share.live else {}
    return out | {name: value + share.reference_bytes for name, value in phases.items()}
