"""Which parallel plan a built model gets.

The model layer is single-device code; its parallelism is applied from here. Each backend's
plan is a function `(handle, world, cfg) -> None` that shards the handle's module in place (and
sets `handle.vocab_parallel` when it shards the head over the vocabulary). The built-in plans
are imported on first use, so a native run never imports the transformers plan.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from titanite.core.config import Config
from titanite.core.errors import UserError
from titanite.models.handle import ModelHandle
from titanite.models.stage import Part
from titanite.parallel.distributed import World

Plan = Callable[[ModelHandle, World, Config], None]
_BUILTIN = {"qwen3": "titanite.parallel.qwen3:parallelize_qwen3", "hf": "titanite.parallel.hf:parallelize_hf"}
_PLANS: dict[str, Plan] = {}


def register_plan(backend: str, plan: Plan) -> None:
    """The plan for a backend registered outside titanite (see models/spec.register_spec)."""
    assert backend not in _PLANS and backend not in _BUILTIN, f"a plan for {backend} is registered twice"
    _PLANS[backend] = plan


def parallelize(handle: ModelHandle, world: World, cfg: Config, parts: list[Part] | None = None) -> None:
    """Apply `cfg.parallelism` to the handle's (meta-device) module, in place. parts: the pipeline
    stages this rank runs; the model is cut to them first."""
    if parts is not None:
        handle.keep_parts(parts)
    backend = handle.backend
    if backend not in _PLANS and backend in _BUILTIN:
        module, name = _BUILTIN[backend].split(":")
        _PLANS[backend] = getattr(importlib.import_module(module), name)
    if backend not in _PLANS:
        raise UserError(f"model.spec = '{backend}' has no parallel plan (titanite.parallel.plans.register_plan)")
    _PLANS[backend](handle, world, cfg)
    if world.cp > 1:  # every backend alike: the attention call sites gather the whole sequence
        from titanite.parallel import context

        if not context.apply(handle.module, world.device.type, torch.float32):
            raise UserError(f"parallelism.cp = {world.cp}, but model.spec = '{backend}' has no titanite attention "
                            "call sites to make context-parallel")
