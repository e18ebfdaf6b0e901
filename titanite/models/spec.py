"""ModelSpec: the registry of backends. `model.spec` names one; its `build` returns a handle.

A backend is a module with `build(cfg: ModelConfig) -> ModelHandle` (see handle.py). The
built-in ones are imported on first use, by path, so this file imports no backend and a missing
optional dependency (transformers for "hf") only matters to the backend that needs it. Adding
a backend touches no file in the trainer: register it here (or with `register_spec`) and give
`titanite.parallel` its plan.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from titanite.core.config import ModelConfig
from titanite.core.errors import UserError, did_you_mean
from titanite.models.handle import ModelHandle

_BUILTIN = {"qwen3": "titanite.models.qwen3.handle", "hf": "titanite.models.hf.handle"}
# The backend `titanite generate` decodes with (its handle supports_generation): other backends'
# models are exported to the Hugging Face layout and loaded into it.
GENERATION_SPEC = "qwen3"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[ModelConfig], ModelHandle]  # the model on the meta device, in its handle


_SPECS: dict[str, ModelSpec] = {}


def register_spec(spec: ModelSpec) -> ModelSpec:
    assert spec.name not in _SPECS and spec.name not in _BUILTIN, f"spec {spec.name} registered twice"
    _SPECS[spec.name] = spec
    return spec


def get_spec(name: str) -> ModelSpec:
    if name not in _SPECS and name in _BUILTIN:
        try:
            module = importlib.import_module(_BUILTIN[name])
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "titanite":
                raise
            raise UserError(f"config key 'model.spec' = '{name}' needs the {e.name} package: {e}") from e
        _SPECS[name] = ModelSpec(name, module.build)
    if name not in _SPECS:
        known = sorted({*_SPECS, *_BUILTIN})
        raise UserError(f"config key 'model.spec': unknown spec '{name}'{did_you_mean(name, known)}; "
                        f"specs: {', '.join(known)}")
    return _SPECS[name]
