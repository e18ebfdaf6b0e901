"""titanite: a PyTorch-native trainer for Qwen3, dense and MoE.

The public API is loaded on first use, so importing one layer (`titanite.models`, say) does not
pull in the others through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["load_pretrained", "save_pretrained", "kernels", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("load_pretrained", "save_pretrained"):
        return getattr(importlib.import_module("titanite.api"), name)
    if name == "kernels":
        return importlib.import_module("titanite.kernels")
    raise AttributeError(f"module 'titanite' has no attribute {name!r}")
