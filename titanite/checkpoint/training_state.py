"""Training-state checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, safe.

Layout of `<output_dir>/checkpoints/step-N/`: the DCP shards (`*.distcp`) and `.metadata`
(model, optimizer tensors, RNG), `trainer_state.json` (step, data position), the run's
`config.toml`, and `manifest.json` (size + SHA-256 of every other file), written last.

This module holds the layout, what a checkpoint holds (`state_to_save`), the clean-up at start
(`remove_stale_temporaries`), verification and loading; saving.py writes checkpoints, in the
step or in the background. A kill at any point of a save leaves either a temporary folder
(removed on the next start) or a complete checkpoint.

A load verifies the manifest (sizes and hashes, split across ranks), reads the DCP metadata
with a restricted unpickler, checks it against the model and optimizer (first mismatching key
and shape), and only then lets DCP read tensors, through `SafeReader`/`TensorOnlyPlanner`
(dcp_safe.py). Any failure is a `CheckpointUnusable` naming the folder and the cause; the
trainer then falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanite.core.errors import UserError
from titanite.device.choice import rng_state, set_rng_state
from titanite.formats import dcp_safe, manifest
from titanite.parallel.distributed import gather_texts, global_rank, global_world_size

log = logging.getLogger("titanite")

_STEP_DIR = re.compile(r"step-(\d+)")
STATE_FILE = "trainer_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# Training state is what trains: a LoRA model's frozen base is re-read from model.hf_path, so a
# checkpoint holds only its adapters (and every buffer). A full fine-tune freezes nothing.
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


class CheckpointUnusable(UserError):
    """A checkpoint folder that cannot be resumed from: incomplete, corrupt, unsafe, or of
    another model. The message names the folder and the first problem."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_complete(d: Path) -> bool:
    return all((d / f).is_file() for f in (STATE_FILE, dcp_safe.METADATA_NAME, manifest.MANIFEST_NAME))


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place, manifest written), oldest first. Whether their
    bytes are intact is `verify`'s to say."""
    found = []
    if ckpt_root.is_dir():
        for d in ckpt_root.iterdir():
            m = _STEP_DIR.fullmatch(d.name)
            if m and d.is_dir() and _is_complete(d):
                found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def _tensor_items(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


# -- what a save holds (saving.py writes it), and the clean-up at start ------------------------


def state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds, as DCP state: the trainable weights, the optimizer's tensors and
    the generators (live tensors: save or stage them before the next step changes them)."""
    return {"model": get_model_state_dict(model, options=_TRAINABLE),
            "optim": _tensor_items(get_optimizer_state_dict(model, optimizer, options=_FLAT)),
            "rng": rng_states(_device_of(model))}


def remove_stale_temporaries(ckpt_root: Path) -> None:
    """Drop half-written saves left by a crash (never touches complete checkpoints). A complete
    checkpoint that a re-save had moved aside is put back when its replacement never arrived."""
    if global_rank() == 0 and ckpt_root.is_dir():
        for d in ckpt_root.glob(".old-step-*"):
            final = ckpt_root / d.name.removeprefix(".old-")
            if not final.exists() and _is_complete(d):
                os.rename(d, final)
            else:
                shutil.rmtree(d, ignore_errors=True)
        for d in ckpt_root.glob(".tmp-step-*"):
            log.warning("removing incomplete checkpoint %s (a save was interrupted)", d)
            shutil.rmtree(d, ignore_errors=True)
        for d in ckpt_root.glob(".del-step-*"):  # pruning was interrupted
            shutil.rmtree(d, ignore_errors=True)
    _barrier()


# -- verifying and loading -------------------------------------------------------------------


def verify(path: Path) -> list[str]:
    """Problems that make `path` unusable, [] when it is intact: the manifest is complete, names
    only files inside the folder, covers every file the DCP metadata points into, and every
    file has its recorded size and SHA-256. The metadata is read with the restricted
    unpickler. Under torch.distributed the hashing is split across ranks and every rank gets the
    whole answer."""
    try:
        files = manifest.read(path)
        problems = manifest.check_sizes(path, files)
        for required in (STATE_FILE, dcp_safe.METADATA_NAME):
            if required not in files:
                problems.append(f"the manifest does not cover {required}")
    except UserError as e:
        problems, files = [str(e)], {}
    names = sorted(files)
    mine = names[global_rank()::global_world_size()]
    problems += [p for text in gather_texts(json.dumps(manifest.check_hashes(path, files, mine)))
                 for p in json.loads(text)]
    if problems:
        return problems
    try:
        metadata = dcp_safe.read_metadata(path)
        unlisted = sorted({i.relative_path for i in metadata.storage_data.values()} - set(files))
        if unlisted:
            problems.append(f"the DCP metadata points into {unlisted[0]}, which the manifest does not cover")
        read_trainer_state(path)
    except UserError as e:
        problems.append(str(e))
    return problems


def verify_command(target: Path) -> int:
    """`titanite checkpoint verify DIR`: one line per checkpoint; 0 when all are intact, else 2."""
    if (target / manifest.MANIFEST_NAME).is_file() or _STEP_DIR.fullmatch(target.name):
        folders = [target]
    else:
        root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        folders = sorted((d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name) and d.is_dir()),
                         key=lambda d: int(d.name.split("-")[1])) if root.is_dir() else []
        if not folders:
            raise UserError(f"{target} holds no checkpoints (expected checkpoints/step-N folders)")
    bad = 0
    for folder in folders:
        problems = verify(folder)
        if problems:
            bad += 1
            print(f"{folder}: FAILED: " + "; ".join(problems))
        else:
            files = manifest.read(folder)
            size = sum(e["size"] for e in files.values())
            print(f"{folder}: ok ({len(files)} files, {size / 2**20:.1f} MiB, hashes match)")
    if bad:
        print(f"titanite: error: {bad} of {len(folders)} checkpoints failed verification", file=sys.stderr)
        return 2
    return 0


def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json, checked: a JSON object whose `step` matches the folder name."""
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file} is unreadable: {e}") from None
    m = _STEP_DIR.fullmatch(path.name)
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or step < 0 or (m and int(m.group(1)) != step):
        raise UserError(f"{file}: 'step' is {step!r}, which does not match the folder {path.name}")
    return state


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Verify `path`, then restore model (and optimizer, RNG) in place; returns the trainer
    state. Raises CheckpointUnusable naming the folder and the first problem."""
    problems = verify(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointUnusable(f"checkpoint {path} failed verification: {problems[0]}{more}")
    trainer_state = read_trainer_state(path)
    model_sd = get_model_state_dict(model, options=_TRAINABLE)
    state: dict[str, Any] = {"model": model_sd}
    optim_full = None
    if optimizer is not None:
        optim_full = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        state["optim"] = _tensor_items(optim_full)
    try:
        metadata = dcp_safe.read_metadata(path)
        if optimizer is not None:  # the device's generator too, where the run saved one
            state["rng"] = rng_states(_device_of(model), with_device="rng.device" in metadata.state_dict_metadata)
        dcp_safe.check_compatible(metadata, state, path)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp_safe.SafeReader(str(path)), planner=dcp_safe.TensorOnlyPlanner(),
                     no_dist=not dist.is_initialized())
    except UserError as e:
        raise CheckpointUnusable(str(e)) from None
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointUnusable(f"checkpoint {path} cannot be loaded into this model/optimizer: "
                                 f"{_first_line(e)}") from None
    # Strict unless the model has frozen weights, which the checkpoint leaves out by design (the
    # loaded keys were checked against the checkpoint above either way).
    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not frozen))
    if optimizer is not None:
        optim_full.update(state["optim"])
        set_optimizer_state_dict(model, optimizer, optim_full, options=_FLAT)
        torch.set_rng_state(state["rng"]["cpu"])
        if "device" in state["rng"]:
            set_rng_state(_device_of(model), state["rng"]["device"])
    return trainer_state


def rng_states(device: torch.device, with_device: bool = True) -> dict[str, torch.Tensor]:
    """The generators a resume restores: the CPU's, and the accelerator's own (dropout and
    random init draw from it), so that a resumed run continues bit for bit."""
    states = {"cpu": torch.get_rng_state()}
    device_state = rng_state(device) if with_device else None
    if device_state is not None:
        states["device"] = device_state
    return states


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _first_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        exc = next(iter(e.failures.values()))[0]
        if isinstance(exc, UserError):
            return str(exc)
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


T = TypeVar("T")


def newest_usable(ckpt_root: Path, attempt: Callable[[Path], T]) -> tuple[Path, T] | None:
    """`attempt(path)` on the complete checkpoints under `ckpt_root`, newest first, until one
    does not raise CheckpointUnusable (each failure is logged with its reason). None when there
    is no checkpoint; UserError listing the reasons when there are some and none is usable."""
    found = list_checkpoints(ckpt_root)
    complete = {path for _, path in found}
    for d in sorted(ckpt_root.glob("step-*")) if ckpt_root.is_dir() else ():
        if d not in complete:
            log.warning("%s is not a complete checkpoint (no %s, %s or %s): skipped", d, manifest.MANIFEST_NAME,
                        STATE_FILE, dcp_safe.METADATA_NAME)
    reasons = []
    for _, path in reversed(found):
        try:
            return path, attempt(path)
        except CheckpointUnusable as e:
            log.warning("cannot use %s: %s; trying the previous checkpoint", path.name, e)
            reasons.append(f"{path.name}: {e}")
    if not found:
        return None
    raise UserError(f"no usable checkpoint in {ckpt_root} ({'; '.join(reasons)}). Repair or move "
                    "them aside, or set checkpoint.resume = false to start over")


def resume(ckpt_root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, dict[str, Any]] | None:
    """Restore the newest usable checkpoint under `ckpt_root` (see newest_usable)."""
    return newest_usable(ckpt_root, lambda path: load(path, model, optimizer))
