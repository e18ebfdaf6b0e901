"""The estimate as `titanite estimate` prints it: the layout, memory per rank part by part and
phase by phase, FLOPs per step and the time a step takes at the device's peak."""

from __future__ import annotations

from titanite.config import Config
from titanite.device import Peak
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


def report(e: Estimate, cfg: Config, peak: Peak | str | None = None) -> str:
    """The estimate as printed; `peak`: the device peak for MFU, or a line saying why none is known."""
    d = e.dims
    transient = "FSDP gathers, unsharded grads"
    if e.lora is not None:
        experts = ", effective expert weights" if e.lora.experts_adapted else ""
        transient = f"FSDP gathers, unsharded adapter grads{experts}"
    rows = _state_rows(e) + [
        (f"activations (micro-batch {cfg.training.batch_size} x {cfg.data.seq_len}, "
         f"checkpointing {cfg.parallelism.activation_checkpoint})", e.activations),
        ("recomputed block (checkpointing)", e.recompute), (f"transient ({transient})", e.transient)]
    rows += [(f"at {name}", value) for name, value in e.phases.items()]
    rows.append(("peak (the largest phase)", e.total))
    width = max(len(r[0]) for r in rows)
    lines = [f"layout: {d.describe()}, mixed precision {cfg.training.mixed_precision}"]
    lines += _lora_line(e, cfg) + ["memory per rank:"]
    lines += [f"  {name:<{width}}  {value / GiB:10.3f} GiB" for name, value in rows]
    lines.append(f"FLOPs per step per rank: {e.flops_per_step:.3e} "
                 f"({e.tokens_per_step} tokens per step over all ranks)")
    if isinstance(peak, str):
        lines.append(f"device peak for MFU: {peak}")
    elif peak is not None:  # the peak the trainer's MFU uses, from the same table or measurement
        lines.append(f"device peak for MFU: {peak.describe()}; one step takes at least "
                     f"{e.flops_per_step / peak.flops:.3g} s at that peak, {e.flops_per_step / (0.4 * peak.flops):.3g} s "
                     "at 40% MFU")
    return "\n".join(lines)
