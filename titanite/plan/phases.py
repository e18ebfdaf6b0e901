"""The peak of a step, moment by moment: what `titanite estimate` reports as its peak.

The parts titanite/plan/counts.py counts (states, activations, transients) are not all alive at
once, so the peak is the largest of four moments of a step (`Estimate.phases`), each counted
from what the step holds then (gradients are set to None after every step, so backward starts
without them):
- loss backward: parameters, optimizer state, the kept activations and the transients, with the
  loss's backward temporaries: beside the kept log-softmax, its gradient and the NLL's (all fp32
  [tokens, V]); for the chunked loss, its fp32 head gradient and one chunk's rebuilt logits;
  untied under FSDP, the head's group gathered;
- blocks' backward: the same without the loss's activations, with the recomputed block and the
  head's gradient;
- backward end: parameters, optimizer state and every gradient, with the vocabulary matrix's last
  gradients before they are reduced. One process sums the head's and the embedding's fp32
  gradients into a third tensor. Under FSDP, tied, the root group is still gathered beside the
  head's and the embedding's unsharded gradients and their sum; then the reduce-scatter takes an
  fp32 input (gloo, on CPU, clones it and allocates half as much again outside torch); the first
  block's reduce-scatter is still in flight beside either;
- optimizer step: parameters, gradients and both moments (the fused AdamW adds no temporaries).
With gradient accumulation (training.global_batch_size > batch_size x data-parallel ranks), every
micro-batch after the first runs its forward and backward beside the gradients the earlier ones
left (fp32, sharded under FSDP, which reduce-scatters each micro-batch's): both backward moments
hold them too.
Some buffers live until a collective completes, which varies from step to step. Untied under
FSDP, the head's all-gather output can outlive the copy into its parameters, and (gloo) the clone
of the head's reduce-scatter input can outlive that reduce-scatter into the embedding's: up to
one vocabulary matrix in the compute dtype and one in fp32 above the phases. They are left out:
counted, the estimate was 14% above a measured 2-rank run (docs/performance.md).
tests/plan/test_estimate_peak.py holds the phases to the peak torch allocates in a real step.
"""

from __future__ import annotations

import math

from titanite.core.config import Config
from titanite.kernels.chunked_loss import chunk_rows
from titanite.models.qwen3.args import Qwen3Args
from titanite.parallel.mesh import ParallelDims
from titanite.plan.counts import Tensor, uses_fsdp


def accumulation_steps(cfg: Config, d: ParallelDims) -> int:
    """Micro-batches per optimizer step on each rank (as preflight counts them)."""
    t = cfg.training
    return max(1, (t.global_batch_size or t.batch_size * d.dp) // (t.batch_size * d.dp))


def step_phases(cfg: Config, a: Qwen3Args, d: ParallelDims, top: list[Tensor], tokens: int, keeps_logits: bool,
                memory: list[float], block_grads: int, on_gloo: bool, gloo_buffers: bool,
                loss_terms: tuple[float, float] | None = None, first: bool = True, last: bool = True,
                pipelined: bool = False) -> dict[str, float]:
    """The peak bytes per rank at each of a step's heaviest moments (the module docstring says
    what each holds). `tokens`: this rank's tokens of a micro-batch (S / cp of each sequence under
    context parallelism). `top`: the vocabulary matrices as a rank holds them before FSDP; `memory`:
    [params, grads, optimizer, activations, recompute, transient] as estimator._full_memory counts them;
    `block_grads`: the largest block's unsharded gradient elements. `loss_terms`: (what the loss
    keeps, what its backward adds on top), for another objective's loss (DPO's,
    titanite/plan/preference.py) instead of the language model's below. `first`, `last`: whether
    the rank holds the embedding and the head (one pipeline rank may hold neither, titanite/plan/
    pipeline.py); `pipelined`: a pipeline step, whose earlier micro-batches left gradients behind
    whatever the accumulation."""
    params, grads, optimizer, kept, recompute, transient = memory
    c = 2 if cfg.training.mixed_precision == "bf16" else 4  # the compute copy and its gradients
    vocab = top[0].numel  # the embedding (and, tied, the head), this rank's tensor-parallel part
    shard = math.ceil(top[0].rows / d.fsdp_shard) * top[0].row_elems  # its FSDP shard
    logits = tokens * top[0].rows * 4.0  # one fp32 [tokens, V / tp]
    sharded = uses_fsdp(d)
    # untied under FSDP: the head's group gathered for its backward (tied, the head is the root,
    # in `transient`)
    head = c * vocab if sharded and not a.tie_word_embeddings and last else 0.0
    # head_grad: what the blocks' backward holds of the head's gradient; vocab_end: what the end
    # of backward holds of the vocabulary matrices' gradients (the embedding's comes last)
    if cfg.lora.enabled:  # the head and the embedding are frozen: no vocabulary gradients
        head_grad = vocab_end = 0.0
    elif not sharded:  # the head's gradient becomes .grad; tied, the embedding's is summed into it
        head_grad, vocab_end = (4 * vocab if last else 0.0), (8 * vocab if a.tie_word_embeddings else 0)
    else:
        head_grad = c * vocab if last else 0.0  # unsharded, until the reduce-scatter
        # The vocabulary matrix's reduce-scatter: its unsharded gradient beside the fp32 input
        # (the output is the shard `grads` counts). gloo clones that input, and its own buffers
        # (outside torch's allocator) take half as much again.
        gloo = 4 * vocab + (2 * vocab if gloo_buffers else 0) if on_gloo else 0
        vocab_end = c * vocab + 4 * vocab + gloo if first else 0.0
        if a.tie_word_embeddings:  # before it: the gathered root, the head's and the embedding's
            # gradients and their sum, without the root's shard
            vocab_end = max(vocab_end, 4 * c * vocab - 4 * shard)
        # beside either, the first block's reduce-scatter, still in flight: its input (and gloo's clone)
        vocab_end += (8 if on_gloo else 4) * block_grads
    if keeps_logits and d.tp == 1:
        # kept: the logits and their log-softmax (activation_bytes); in the loss's backward the
        # logits are gone and the log-softmax sits beside its gradient and the NLL's, all fp32
        loss_kept = 2 * logits * c / 4
        loss = 3 * logits - loss_kept
    elif keeps_logits:  # the vocabulary-parallel loss keeps both; its backward adds three more
        loss_kept = 2 * logits * c / 4
        loss = 3 * logits
    else:  # the chunked loss: one chunk's logits at a time, kept only as one value per token
        loss_kept = tokens * c
        chunk = min(tokens, chunk_rows(top[0].rows)) * top[0].rows
        cast = c if c != 4 else 0  # a 16-bit product is cast to fp32 and back
        # forward: the chunk's fp32 logits and logsumexp's shifted copy; backward: the fp32 head
        # gradient beside one rebuilt fp32 chunk and its 16-bit cast, then that cast beside its
        # 16-bit [V, H] product
        loss = max(8 * chunk, 4 * vocab + max((4 + cast) * chunk, cast * (chunk + vocab)))
    if loss_terms is not None:
        loss_kept, loss = loss_terms
    if not last:  # a pipeline rank without the head: no loss
        loss_kept = loss = 0.0
    states = params + optimizer
    # the gradients are None until backward makes them, unless earlier micro-batches left theirs
    during = states + (grads if pipelined or accumulation_steps(cfg, d) > 1 else 0.0)
    return {"loss backward": during + kept + transient + head + loss,
            "blocks' backward": during + kept - loss_kept + recompute + transient + head_grad,
            "backward end": states + grads + vocab_end,
            "optimizer step": params + grads + optimizer}
