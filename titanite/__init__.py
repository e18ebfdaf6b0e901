"""titanite: a PyTorch-native trainer for Qwen3, dense and MoE."""

from __future__ import annotations

from titanite import kernels
from titanite.api import load_pretrained, save_pretrained

__version__ = "0.1.0"
__all__ = ["load_pretrained", "save_pretrained", "kernels", "__version__"]
