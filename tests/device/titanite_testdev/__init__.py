"""titanite's test device `tdev`: an out-of-tree PrivateUse1 backend, loaded only on import.

Importing this package loads the C++ backend (allocator, device guard, generators, hooks,
autocast policy, CPU fallback), renames PrivateUse1 to `tdev`, registers `torch.tdev` and the
c10d backend `tdevccl` for the device type. PrivateUse1 can be renamed once per process: if
another backend holds it, the import fails with a message naming it.
"""

from __future__ import annotations

import torch

NAME = "tdev"
C10D_BACKEND = "tdevccl"


def _claim_privateuse1() -> None:
    held = torch._C._get_privateuse1_backend_name()
    if held not in ("privateuseone", NAME):
        raise RuntimeError(f"titanite_testdev: PrivateUse1 is already the '{held}' backend in this process; "
                           "the test device cannot load beside it")
    if held != NAME:
        torch.utils.rename_privateuse1_backend(NAME)


_claim_privateuse1()

from titanite_testdev import (
    _C,  # noqa: E402  (registers the backend's kernels and hooks)
    device_module,  # noqa: E402
)

if not hasattr(torch, NAME):
    torch._register_device_module(NAME, device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)

from titanite_testdev import c10d  # noqa: E402

c10d.register()

__all__ = ["NAME", "C10D_BACKEND", "_C"]
