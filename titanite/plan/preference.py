"""Preference tuning's share of `titanite estimate` (`training.objective = "dpo"`);
titanite/plan/counts.py, lora.py and estimator.py count the rest.

A DPO micro-batch of `training.batch_size` pairs is 2 x batch_size sequences (the chosen rows,
then the rejected ones), each padded to data.seq_len, so the policy's activations are those of
2 x batch_size sequences. Each sequence's summed log-probability comes from the model's `loss`
op one sequence at a time (titanite/run/preference/reference.py, sequence_logps, and
kernels.loss_per_row), with `kernels.loss` chosen as for language-model training ('auto': the
chunked op when the micro-batch's fp32 logits would take over a tenth of the device):
- the chunked op keeps one fp32 log-sum-exp per token; its backward holds one chunk of one
  sequence, the head's fp32 gradient and that gradient summed over the sequences;
- the reference op keeps each sequence's fp32 log-softmax [S, V] (all of the micro-batch's
  until backward); its backward holds one sequence's two fp32 gradients (and their 16-bit cast);
- under tensor parallel the head's vocabulary-sharded logits are gathered whole and the
  cross-entropy runs on the whole micro-batch: its fp32 log-softmax [2B x S, V], the whole
  vocabulary on every rank, then three of them in backward.

The reference policy, as titanite/run/preference/reference.py holds it (preference.reference and
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
checkpointing, counts.layer_activation_elems) or, at the head, the final hidden states and one
sequence's loss op (the reference op: its logits in the compute dtype, their fp32 copy and
log-softmax; the chunked op: one chunk), or under tensor parallel the whole micro-batch's
gathered logits, whichever is larger; and, under FSDP, its gathered copies: the biggest block,
current and prefetched, and, untied, the head's group (tests/plan/test_preference_estimate.py holds
this to the bytes a real no-grad forward allocates).
It is a moment of its own ("reference forward"): the reference runs first in each micro-batch,
before the policy's forward (titanite/run/preference/objective.py), so beside it the policy holds
its states only: parameters and optimizer state, and, with gradient accumulation, the gradients
of the earlier micro-batches. With LoRA the reference's forward is the policy's module, whose
FSDP root group (tied embeddings) it gathers, and which stays gathered into the policy's forward.

FLOPs: the policy's training FLOPs for 2 x batch_size sequences per micro-batch, plus one
forward (a third of the full training FLOPs per token, titanite.models.flops) of the reference
over the same tokens when it is live.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanite.core.config import Config
from titanite.kernels.chunked_loss import chunk_rows
from titanite.models.flops import flops_per_token
from titanite.models.handle import ActivationProfile
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims
from titanite.plan.counts import Tensor, layer_activation_elems, sharded, uses_fsdp
from titanite.run.preference.reference import adapters_are_reference, uses_reference

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
    forward_bytes: float  # its no-grad forward at the peak (transient; 0 without a live reference)
    forward_flops_per_step: float  # per rank, the reference's forwards (included in Estimate.flops_per_step)
    loss: str = ""  # how the sequences' log-probabilities are computed, for the report

    @property
    def reference_bytes(self) -> float:
        """What the reference holds in every moment of the step."""
        return self.params_bytes

    @property
    def live(self) -> bool:
        """A reference forward runs in the step (a second copy, or the base with adapters off)."""
        return self.kind in ("model", "adapters off")

    def describe(self) -> str:
        return KINDS[self.kind]


def is_preference(cfg: Config) -> bool:
    return cfg.training.objective == "dpo"


def reference_kind(cfg: Config) -> str:
    """The reference a DPO config trains with (titanite/run/preference/reference.py decides): 'model',
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
    return sum(x.numel for x in top) * c if uses_fsdp(d) and a.tie_word_embeddings else 0.0


def loss_values(cfg: Config, a: Qwen3Args, d: ParallelDims, keeps_logits: bool) -> float:
    """Values per token (compute-dtype units, as counts.activation_bytes counts them) that the DPO
    loss keeps for backward: the fp32 log-softmax over the whole vocabulary (the reference loss
    op, or, under tensor parallel, the gathered logits), or the chunked loss's fp32 log-sum-exp."""
    c = _compute_bytes(cfg)
    return 4 * a.vocab_size / c if keeps_logits or d.tp > 1 else 4 / c


def loss_terms(cfg: Config, a: Qwen3Args, d: ParallelDims, top: list[Tensor], tokens: int,
               keeps_logits: bool) -> tuple[float, float]:
    """(bytes the DPO loss keeps, bytes its backward adds on top at its peak), per rank, for
    phases.step_phases. One sequence at a time through the loss op (the module docstring): the
    backward's temporaries are one sequence's, the reference op's fp32 gradients of its NLL and
    log-softmax, or the chunked op's fp32 head gradient and one chunk, beside the head's gradient
    the sequences before it left (a trained head: not LoRA's). Each call casts the head
    matrix to a 16-bit compute dtype itself when it is stored in fp32 without FSDP (FSDP gathers
    it in that dtype already) and keeps its copy for backward: one per sequence, where the
    language model's single call keeps one (in the transients). Under tensor parallel, the whole
    micro-batch's gathered logits: two fp32 gradients and their cast beside the kept log-softmax,
    then the vocabulary shard's gradient."""
    c, V, S = _compute_bytes(cfg), a.vocab_size, cfg.data.seq_len
    kept = tokens * loss_values(cfg, a, d, keeps_logits) * c
    cast = c if c != 4 else 0  # a 16-bit product is cast to fp32, and its gradient back
    if d.tp > 1:
        return kept, tokens * (V * (8 + cast) + top[0].rows * c)
    vocab = top[0].numel
    stored_fp32 = not cfg.lora.enabled or cfg.lora.base_dtype == "fp32"
    copies = (tokens // S - 1) * c * vocab if not uses_fsdp(d) and cast and stored_fp32 else 0
    if keeps_logits:
        return kept, 8.0 * S * V + copies
    chunk = min(S, chunk_rows(V)) * V
    summed = 4 * vocab if not cfg.lora.enabled and tokens > S else 0  # the head's gradient of the rows before
    return kept, max(8 * chunk, 4 * vocab + max((4 + cast) * chunk, cast * (chunk + vocab)) + summed) + copies


def reference_forward_bytes(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]],
                            top: list[Tensor], tokens: int, profile: ActivationProfile) -> float:
    """Bytes per rank the reference's no-grad forward adds at its peak (the module docstring):
    one block's working values or, at the head, the final hidden states with one row's logits
    (the reference op: in the compute dtype, their fp32 copy and log-softmax; the chunked op: one
    chunk's fp32 logits and logsumexp's shifted copy; under tensor parallel the whole micro-batch's,
    gathered), and, under FSDP, its gathered copies in the compute dtype: the biggest block twice
    (current, prefetched), the head's group when untied, and the root group when tied (a separate
    reference reshards its root after its forward, so it holds none of it between forwards)."""
    c, V, S = _compute_bytes(cfg), a.vocab_size, cfg.data.seq_len
    cast = 4 if c != 4 else 0
    block = max(layer_activation_elems(a, i, d.tp, "none", profile.sequence_parallel)
                for i in range(a.num_layers)) * tokens * c
    if d.tp > 1:
        logits = tokens * (top[0].rows * c + V * (c + cast + 4))
    elif profile.keeps_logits:
        logits = S * V * (c + cast + 4)
    else:
        logits = 8 * min(S, chunk_rows(V)) * V
    head = tokens * a.hidden_size * (c + cast) + logits  # the final hidden states (16-bit: and their fp32 norm)
    gathered = 0.0
    if uses_fsdp(d):
        gathered = 2 * max(sum(x.numel for x in layer) for layer in layers) * c
        gathered += _root(a, d, top, c)
        gathered += 0.0 if a.tie_word_embeddings else top[0].numel * c  # the head's group, for the logits
    return max(block, head) + gathered  # the block's values are gone when the head runs


def preference_share(cfg: Config, a: Qwen3Args, d: ParallelDims, layers: list[list[Tensor]], top: list[Tensor],
                     tokens: int, profile: ActivationProfile, world_size: int,
                     global_tokens: int) -> PreferenceShare:
    """The reference's bytes and FLOPs for a DPO config. `layers`, `top`: the model's tensors as a
    rank holds them before FSDP; `tokens`: one micro-batch's (both sequences of each pair);
    `global_tokens`: one optimizer step's over all ranks."""
    kind = reference_kind(cfg)
    params = forward = flops = 0.0
    if kind == "model":
        params = sharded([x for layer in layers for x in layer] + top, d) * 4.0
    if kind in ("model", "adapters off"):
        forward = reference_forward_bytes(cfg, a, d, layers, top, tokens, profile)
        flops = flops_per_token(a, cfg.data.seq_len) / 3 * global_tokens / world_size
    if d.tp > 1:
        loss = "from the vocabulary-sharded logits, gathered whole (fp32)"
    elif profile.keeps_logits:
        loss = "from the loss op one sequence at a time (each keeps its fp32 log-softmax)"
    else:
        loss = "from the chunked loss op one sequence at a time (no [S, V] logits kept)"
    return PreferenceShare(kind, sequences_per_micro_batch(cfg), params, forward, flops, loss)


def add_reference(phases: dict[str, float], share: PreferenceShare, before_forward: float) -> dict[str, float]:
    """The step's moments with the reference: what it holds in each, and its forward first
    (`before_forward`: what the policy holds then, the module docstring)."""
    out = {"reference forward": before_forward + share.reference_bytes + share.forward_bytes} if share.live else {}
    return out | {name: value + share.reference_bytes for name, value in phases.items()}
