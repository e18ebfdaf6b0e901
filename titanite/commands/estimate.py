"""`titanite estimate`: the command line. It picks the world size and the machines planned for
(this one, or a named accelerator: its MFU peak and its memory), prints the estimate and, with
--rehearse, the rehearsal beside it, and with --device-memory-gib whether the training peak fits
(else a layout that would: pipeline, context, tensor and expert parallel degrees, activation
checkpointing; rehearse.fitting_layout). Under pipeline parallelism the rehearsal builds the first
and the last pipeline rank's stages and the most loaded one's, each compared with the estimate of
its own pipeline rank."""

from __future__ import annotations

import argparse

import torch

from titanite.core.config import Config, ParallelismConfig, load_config
from titanite.core.errors import UserError
from titanite.device import accelerators
from titanite.device.choice import pick_device
from titanite.device.peak import Peak, peak_flops
from titanite.plan.counts import GiB
from titanite.plan.estimator import estimate
from titanite.plan.rehearse import fitting_layout, rehearse
from titanite.plan.rehearse import report as rehearsal_report
from titanite.plan.report import report


def smallest_world(p: ParallelismConfig) -> int:
    """The fewest ranks `[parallelism]` lays out on: pp x dp_replicate x dp_shard x cp x tp, where
    dp_shard = -1 (the rest of the world) takes the fewest ranks that expert parallelism can
    borrow from it: ep. (A fixed dp_shard that ep does not divide fits no world;
    ParallelDims.resolve says so.)"""
    return p.pp * p.dp_replicate * (p.dp_shard if p.dp_shard > 0 else p.ep) * p.cp * p.tp


def _named_accelerator(args: argparse.Namespace) -> accelerators.Accelerator | None:
    """--device-name's table entry; it implies --plan-for accelerator and, unless given,
    --device-memory-gib."""
    if not args.device_name:
        return None
    acc = accelerators.lookup(args.device_name)
    if acc is None:
        raise UserError(f"--device-name '{args.device_name}' is not a known accelerator; known: "
                        f"{', '.join(accelerators.names())} (for another, pass --plan-for accelerator, "
                        "--metrics.peak_tflops=T and --device-memory-gib G)")
    if args.plan_for not in ("auto", "accelerator"):
        raise UserError(f"--device-name '{args.device_name}' plans for an accelerator, but --plan-for is 'cpu'")
    args.plan_for = "accelerator"
    args.device_memory_gib = args.device_memory_gib or acc.memory_gib
    return acc


def _planned_peak(cfg: Config, plan_for: str, acc: accelerators.Accelerator | None,
                  dtype: torch.dtype) -> Peak | str:
    """The device peak for MFU on the machines planned for, or why none is known. Planning for
    this machine: the peak training takes here. For an accelerator: metrics.peak_tflops, else the
    named accelerator's (never this machine's)."""
    if plan_for != "accelerator":
        return peak_flops(pick_device(cfg.job.device), dtype, cfg.metrics.peak_tflops)
    if cfg.metrics.peak_tflops > 0:
        return Peak(cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops")
    tflops = acc.peak_tflops(dtype) if acc is not None else None
    if tflops is not None:
        return Peak(tflops * 1e12, acc.peak_source(dtype))
    if acc is None:
        return "unknown (no accelerator named); pass --device-name NAME or set metrics.peak_tflops"
    return f"unknown (no {str(dtype).removeprefix('torch.')} peak for {acc.name}); set metrics.peak_tflops"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titanite estimate",
                                     description="Memory per rank and FLOPs per step for a config's parallel layout.",
                                     epilog="Overrides: --section.key=value, as for train.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--world-size", type=int, default=0,
                        help="ranks (nodes x processes per node); default: the smallest world the layout "
                             "allows (pp x dp_replicate x dp_shard x cp x tp, with dp_shard = -1 taking ep ranks)")
    parser.add_argument("--rehearse", action="store_true",
                        help="also apply the real parallel plan to the real model on the meta device under a "
                             "fake process group of --world-size ranks and report each rank's shards")
    parser.add_argument("--device-memory-gib", type=float, default=0.0,
                        help="the memory of one device: kernels.loss = 'auto' is resolved against it as training "
                             "resolves it there, and a layout that does not fit is named with one that would (with "
                             "--rehearse, by the rehearsal's states); default with --device-name: that accelerator's")
    parser.add_argument("--plan-for", choices=("auto", "cpu", "accelerator"), default="auto",
                        help="the machines the layout is for: 'accelerator' leaves out the CPU collectives' "
                             "(gloo's) buffers when planning GPU runs on a machine without one; default: "
                             "job.device as resolved here")
    parser.add_argument("--device-name", default="",
                        help="the accelerator planned for, which implies --plan-for accelerator: its dense peak "
                             "for MFU (unless metrics.peak_tflops is set) and its memory (unless "
                             f"--device-memory-gib is given); one of {', '.join(accelerators.names())}")
    return parser


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    acc = _named_accelerator(args)
    cfg = load_config(args.config, overrides)
    world = args.world_size or smallest_world(cfg.parallelism)
    if not args.world_size:
        print(f"world size: {world} (the smallest the layout allows; pass --world-size to choose)")
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    peak = _planned_peak(cfg, args.plan_for, acc, dtype)
    on_gloo = {"auto": None, "cpu": True, "accelerator": False}[args.plan_for]
    memory = args.device_memory_gib * GiB or None  # kernels.loss = "auto" resolves against it
    plan = estimate(cfg, world, on_gloo=on_gloo, device_memory=memory)
    print(report(plan, cfg, peak))
    train_peak = plan.total
    if args.rehearse and plan.pipeline is not None:
        train_peak = _rehearse_pipeline(cfg, world, plan, args.device_memory_gib)
    elif args.rehearse:
        figures = rehearse(cfg, world)
        print(rehearsal_report(figures, args.device_memory_gib or None))
        f = max(figures, key=lambda x: x.states + x.reference)
        reference = plan.preference.params_bytes if plan.preference is not None else 0.0
        print(f"  rehearsal / estimate: parameters {f.params / plan.params:.3f}, gradients "
              f"{f.grads / max(plan.grads, 1):.3f}, optimizer {f.optimizer / max(plan.optimizer, 1):.3f}"
              + (f", reference model {f.reference / reference:.3f}" if reference else ""))
        # the phases, with the rehearsal's own states (and reference model)
        train_peak = plan.total - plan.states - reference + f.states + f.reference
    if args.device_memory_gib:
        if train_peak / GiB > args.device_memory_gib:
            better = fitting_layout(cfg, world, args.device_memory_gib, on_gloo)
            print(f"  training peak {train_peak / GiB:.1f} GiB does not fit {args.device_memory_gib:g} GiB; "
                  + (f"this layout would: {better}" if better else f"no layout of {world} ranks would"))
        else:
            print(f"  training peak {train_peak / GiB:.1f} GiB fits {args.device_memory_gib:g} GiB")
    return 0


def _rehearse_pipeline(cfg: Config, world: int, e, device_gib: float) -> float:
    """The rehearsal of a pipelined layout: the first rank, the last and the first rank of the most
    loaded pipeline rank, each against the estimate of its pipeline rank; the training peak with
    the rehearsed states, the largest over those ranks."""
    per_pp = world // e.pipeline.layout.pp
    ranks = sorted({0, world - 1, e.pipeline.worst.pp_rank * per_pp})
    figures = rehearse(cfg, world, ranks)
    print(rehearsal_report(figures, device_gib or None))
    peaks = []
    for f in figures:
        r = e.pipeline.ranks[f.pp_rank]
        params, grads, optimizer = r.memory[:3]
        print(f"  rank {f.rank} (pp rank {f.pp_rank}) rehearsal / estimate: parameters {f.params / params:.3f}, "
              f"gradients {f.grads / grads:.3f}, optimizer {f.optimizer / optimizer:.3f}")
        peaks.append(r.peak - r.states + f.states)
    return max(peaks)
