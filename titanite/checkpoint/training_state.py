"""Training-state checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout: `<output_dir>/checkpoints/step-N/` holds the DCP shards (model, optimizer tensors, RNG),
`trainer_state.json` (step, data position, schedule) and the run's `config.toml`. A save goes
to `.tmp-step-N` and is renamed when complete, so a crash mid-save never leaves a corrupt
latest. Only tensors go through DCP: nothing is unpickled on resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanite.errors import UserError

log = logging.getLogger("titanite")

_STEP_DIR = re.compile(r"step-(\d+)")
STATE_FILE = "trainer_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place, state file present), oldest first."""
    found = []
    if ckpt_root.is_dir():
        for d in ckpt_root.iterdir():
            m = _STEP_DIR.fullmatch(d.name)
            if m and (d / STATE_FILE).is_file() and (d / ".metadata").is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def _tensor_items(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def save(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, Any], config_toml: str, keep_latest: int) -> Path:
    """Save everything needed to resume at `step`; prune to `keep_latest` (0 keeps all)."""
    final = ckpt_root / f"step-{step}"
    tmp = ckpt_root / f".tmp-step-{step}"
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = {"model": get_model_state_dict(model),
             "optim": _tensor_items(get_optimizer_state_dict(model, optimizer, options=_FLAT)),
             "rng": {"cpu": torch.get_rng_state()}}
    with warnings.catch_warnings():  # DCP warns that a single process is assumed: that is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    _barrier()
    if _rank() == 0:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        (tmp / "config.toml").write_text(config_toml)
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after an interrupt): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        _prune(ckpt_root, keep_latest)
    _barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore model (and optimizer, RNG) in place from a checkpoint folder; returns trainer state."""
    if not (path / STATE_FILE).is_file() or not (path / ".metadata").is_file():
        raise UserError(f"{path} is not a complete titanite checkpoint (no {STATE_FILE} or .metadata)")
    model_sd = get_model_state_dict(model)
    state: dict[str, Any] = {"model": model_sd}
    optim_full = None
    if optimizer is not None:
        optim_full = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        state["optim"] = _tensor_items(optim_full)
        state["rng"] = {"cpu": torch.get_rng_state()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:  # DCP reports layout mismatches as generic errors; name the folder
        raise UserError(f"checkpoint {path} does not match this model/optimizer: {e}") from e
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        optim_full.update(state["optim"])
        set_optimizer_state_dict(model, optimizer, optim_full, options=_FLAT)
        torch.set_rng_state(state["rng"]["cpu"])
    return json.loads((path / STATE_FILE).read_text())


def remove_stale_temporaries(ckpt_root: Path) -> None:
    """Drop half-written saves left by a crash (never touches complete checkpoints)."""
    if _rank() == 0 and ckpt_root.is_dir():
        for d in ckpt_root.glob(".tmp-step-*"):
            log.warning("removing incomplete checkpoint %s (a save was interrupted)", d)
            shutil.rmtree(d, ignore_errors=True)
    _barrier()


def _prune(ckpt_root: Path, keep_latest: int) -> None:
    if keep_latest <= 0:
        return
    for _, d in list_checkpoints(ckpt_root)[:-keep_latest]:
        shutil.rmtree(d, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir() if path.is_dir() else ():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
