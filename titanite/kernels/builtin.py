"""Registers titanite's built-in implementations (imported by the registry on first use).

attention: sdpa, flex (CUDA). moe.dispatch: gather. moe.experts: grouped_mm, triton. rms_norm, swiglu: triton.
loss: chunked. Every op also has its `reference`.
"""

from __future__ import annotations

from titanite.kernels import chunked_loss, torch_impls  # noqa: F401  (register on import)
from titanite.kernels.triton import ops as triton_ops  # noqa: F401
