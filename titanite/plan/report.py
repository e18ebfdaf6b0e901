"""The estimate as `titanite estimate` prints it: the layout, memory per rank part by part and
phase by phase, FLOPs per step and the time a step takes at the device's peak, and under context
parallelism the split of each sequence and the CP communication per step, and under pipeline
parallelism the stages, the bubble, each pipeline rank's peak and the point-to-point traffic (the
memory rows are then the most loaded pipeline rank's)."""

from __future__ import annotations

from titanite.core.config import Config
from titanite.device.peak import Peak
from titanite.plan.counts import GiB
from titanite.plan.estimator import Estimate


def _state_rows(e: Estimate) -> list[tuple[str, float]]:
    """The parameter, gradient and optimizer rows (bytes per rank)."""
    if e.lora is None:
        return [("parameters (fp32, sharded)", e.params), ("gradients (fp32, sharded)", e.grads),
                ("optimizer (AdamW, fp32)", e.optimizer)]
    return [(f"parameters: frozen base ({e.lora.base_dtype}, sharded)", e.lora.base_bytes),
            ("parameters: adapters (fp32, sharded)", e.lora.adapter_bytes),
            ("gradients (adapters only, fp32, sharded)", e.grads),
            ("optimizer (AdamW, adapters only, fp32)", e.optimizer)]


def _lora_line(e: Estimate, cfg: Config) -> list[str]:
    """The LoRA run's parameter counts (none for a full fine-tune)."""
    if e.lora is None:
        return []
    n, lo = e.lora, cfg.lora
    return [f"LoRA rank {lo.rank}, alpha {lo.alpha:g}, targets {', '.join(lo.target_modules)}: "
            f"{n.adapters:,} trainable parameters (adapters) of {n.total:,} total "
            f"({n.base:,} frozen base; {100 * n.adapters / n.total:.3g}% trainable)"]


def _preference_lines(e: Estimate, cfg: Config) -> list[str]:
    """A DPO run's pairs and the reference the estimate counted (none for the 'lm' objective)."""
    if e.preference is None:
        return []
    p, pr, S = e.preference, cfg.preference, cfg.data.seq_len
    pairs = f"{cfg.training.batch_size} pair{'s' if cfg.training.batch_size > 1 else ''}"
    lines = [f"DPO (loss {pr.loss_type}, beta {pr.beta:g}): {pairs} per micro-batch = "
             f"{p.sequences} sequences x {S} (chosen, rejected); log-probabilities {p.loss}",
             f"reference ({pr.reference}): {p.describe()}"]
    if p.kind == "model":
        lines[-1] += f", fp32, sharded as the policy, no gradients or optimizer state: " \
                     f"{p.reference_bytes / GiB:.3f} GiB per rank"
    if p.live:
        lines[-1] += f"; its no-grad forward adds {p.forward_bytes / GiB:.3f} GiB at its peak"
    return lines


def report(e: Estimate, cfg: Config, peak: Peak | str | None = None) -> str:
    """The estimate as printed; `peak`: the device peak for MFU, or a line saying why none is known."""
    d = e.dims
    transient = "FSDP gathers, unsharded grads"
    if e.lora is not None:
        experts = ", effective expert weights" if e.lora.experts_adapted else ""
        transient = f"FSDP gathers, unsharded adapter grads{experts}"
    micro = f"{cfg.training.batch_size} x {cfg.data.seq_len}"
    if e.preference is not None:
        pairs = f"{cfg.training.batch_size} pair{'s' if cfg.training.batch_size > 1 else ''}"
        micro = f"{pairs} = {e.preference.sequences} x {cfg.data.seq_len}"
    if e.context is not None:
        micro += f", {e.context.local_tokens} tokens of each per rank"
    if e.pipeline is not None:
        w = e.pipeline.worst
        micro += (f"; pp rank {w.pp_rank}: {w.in_flight} in flight x a stage of up to "
                  f"{max(len(p.layers) for p in w.parts)} blocks")
    rows = _state_rows(e) + [
        (f"activations (micro-batch {micro}, checkpointing {cfg.parallelism.activation_checkpoint})",
         e.activations),
        ("recomputed block (checkpointing)", e.recompute), (f"transient ({transient})", e.transient)]
    if e.context is not None:
        rows += e.context.rows()
    if e.preference is not None and e.preference.kind == "model":
        rows.append(("reference model (frozen, fp32, sharded)", e.preference.params_bytes))
    if e.preference is not None and e.preference.live:
        rows.append(("reference forward (no grad, transient)", e.preference.forward_bytes))
    rows += [(f"at {name}", value) for name, value in e.phases.items()]
    rows.append(("peak (the largest phase)", e.total))
    width = max(len(r[0]) for r in rows)
    lines = [f"layout: {d.describe()}, mixed precision {cfg.training.mixed_precision}"]
    lines += _lora_line(e, cfg) + _preference_lines(e, cfg)
    lines += [e.context.describe(cfg.data.seq_len)] if e.context is not None else []
    lines += e.pipeline.describe() if e.pipeline is not None else []
    lines += ["memory per rank" + (f" (pp rank {e.pipeline.worst.pp_rank}, the most loaded):"
                                   if e.pipeline is not None else ":")]
    lines += [f"  {name:<{width}}  {value / GiB:10.3f} GiB" for name, value in rows]
    lines.append(f"FLOPs per step per rank: {e.flops_per_step:.3e} ("
                 + (f"pp rank {e.pipeline.worst.pp_rank}'s stages; " if e.pipeline is not None else "")
                 + f"{e.tokens_per_step} tokens per step over all ranks)")
    if e.preference is not None and e.preference.live:
        lines[-1] += f", of which the reference's forwards {e.preference.forward_flops_per_step:.3e}"
    if isinstance(peak, str):
        lines.append(f"device peak for MFU: {peak}")
    elif peak is not None:  # the peak the trainer's MFU uses, from the same table or measurement
        idle = 1 - e.pipeline.layout.bubble() if e.pipeline is not None else 1.0  # the pipeline's busy share
        busy = e.flops_per_step / idle
        lines.append(f"device peak for MFU: {peak.describe()}; one step takes at least "
                     f"{busy / peak.flops:.3g} s at that peak, {busy / (0.4 * peak.flops):.3g} s at 40% MFU"
                     + (" (with the bubble)" if e.pipeline is not None else ""))
    return "\n".join(lines)
