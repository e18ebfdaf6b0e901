"""A training run's exports, written by rank 0 while every rank takes part in the gathers: the
Hugging Face folder (titanite/formats/hf_weights.py) and a LoRA run's peft adapter
(titanite/models/lora/adapter.py); and the run's lm-eval benchmarks on its own module."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titanite.core.config import Config
from titanite.data.tokenizer import Tokenizer
from titanite.formats.hf_weights import export_hf
from titanite.models.handle import ModelHandle
from titanite.models.lora import adapter as lora_adapter
from titanite.parallel import distributed
from titanite.run.step_context import StepContext

if TYPE_CHECKING:
    from titanite.evaluation.harness import LoopBenchmarks

log = logging.getLogger("titanite")


def adapter(handle: ModelHandle, cfg: Config, lora_record: dict[str, Any], out: Path, rank: int,
            world: distributed.World | None = None) -> None:
    """The adapters in peft's format (under pipeline parallelism rank 0 receives the other
    stages' factors)."""
    factors = handle.adapter_factors(distributed.full_tensor)  # a collective per target, every rank
    if world is not None and world.pp > 1:
        factors = _stage_factors(handle, world, factors)
    if rank == 0:
        lora_adapter.write_adapter(out, factors, handle.lora.cfg, cfg.model.hf_path, lora_record["lora_base"])
        log.info("exported the LoRA adapter (peft format) to %s", out)
    else:
        for _ in factors:
            pass


def _stage_factors(handle: ModelHandle, world: distributed.World, factors: Any) -> Any:
    """Every pipeline stage's (target, A, B) on rank 0, from this stage's `factors`."""
    from titanite.parallel.pipeline_runner import to_rank_zero

    def pieces(_regions: Any) -> Any:
        for t, a, b in factors:
            yield f"{t.key}\n{_A}", a
            yield f"{t.key}\n{_B}", b

    by_key = {t.key: t for t in handle.lora.all_targets}
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in to_rank_zero(world, pieces):
        key, which = name.split("\n")
        if which == _A:
            pending[key] = tensor
        else:
            yield by_key[key], pending.pop(key), tensor


_A, _B = "lora_A", "lora_B"


def model(handle: ModelHandle, cfg: Config, tokenizer: Tokenizer, out: Path, rank: int, merged: bool = False,
          world: distributed.World | None = None) -> None:
    """The model as a Hugging Face folder (`merged`: LoRA adapters folded into the base). Under
    pipeline parallelism (`world.pp` > 1) rank 0 receives the other stages' tensors."""
    if world is not None and world.pp > 1:
        from titanite.parallel.pipeline_runner import to_rank_zero

        tensors = to_rank_zero(world, lambda regions: handle.hf_state_dict(regions, merged=merged))
    else:
        tensors = handle.hf_state_dict(distributed.regions_to_rank_zero, merged=merged)
    config = handle.hf_config()
    if rank == 0:
        export_hf(tensors, config, out, cfg.checkpoint.export_shard_mb, source_folders=[cfg.model.hf_path],
                  tokenizer_files=tokenizer.files)
        log.info("exported Hugging Face model to %s", out)
    else:
        for _ in tensors:  # every rank takes part in the gathers (it holds meta stand-ins)
            pass


def loop_benchmarks(ctx: StepContext, tokenizer: Tokenizer) -> LoopBenchmarks:
    """lm-eval on a training run's own (possibly sharded) module: every rank runs the same
    requests with full logits (gathered over tensor-parallel shards, never the weights; under
    context parallelism each rank runs the whole sequences, as no layout is active)."""
    import torch.nn.functional as F

    from titanite.evaluation.harness import LoopBenchmarks

    def logits(ids: torch.Tensor) -> torch.Tensor:
        width = ids.shape[1]  # right-padded to a length sequence parallelism can split over tp
        with ctx.autocast:
            return distributed.full_tensor(ctx.model(F.pad(ids, (0, -width % ctx.world.tp))))[:, :width]

    eval_cfg = ctx.cfg.eval
    return LoopBenchmarks(eval_cfg, logits, tokenizer.path.parent, ctx.handle.args.max_position_embeddings,
                          eval_cfg.batch_size or ctx.cfg.training.batch_size, ctx.device, ctx.world.min_over_ranks)
