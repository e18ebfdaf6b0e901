"""The parallel layer: meshes, sharding plans, and the DTensor knowledge the model layer must not import.

Importing any of it registers how a DTensor's local box is found, for titanite.formats.sharded
(which fills sharded models from the model layer without importing torch.distributed).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titanite.formats.sharded import Box, register_sharded_box


def dtensor_box(t: torch.Tensor) -> Box:
    """(offsets, sizes) of this rank's shard of the DTensor `t`, from its mesh and placements."""
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offsets), tuple(sizes)


register_sharded_box(dtensor_box)
