"""Which device a rank uses and how to drive it: the device from a name (`pick_device`), its c10d
backend and `init_process_group` arguments, synchronisation, the compile backend, the RNG state
checkpoints keep, and the predicates other code asks instead of comparing device-type strings
(`is_host`, `default_compute_dtype`).

The device package is the only place that may name a specific accelerator API; everything else
asks here, so CPU, CUDA and out-of-tree devices (e.g. Trainium's `neuron`) share one code path.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from titanite.core.errors import UserError

log = logging.getLogger("titanite")


def pick_device(name: str, source: str = "config key 'job.device'") -> torch.device:
    """'auto' -> the accelerator PyTorch reports (cuda, xpu, neuron, ...) else cpu. Under
    torchrun each rank takes its LOCAL_RANK's device index. Raises UserError, naming `source`
    (where the name came from), for a device type no backend registered, one with no device
    present, and an index past the device count."""
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        name = acc.type if acc is not None else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{source}: unknown device '{name}': no PyTorch backend registered this "
                        f"device type in this process ({_known_device_types()}); an out-of-tree device's extension "
                        "must be installed and imported (or autoloaded by PyTorch) first") from None
    if device.type == "cpu":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        raise UserError(f"{source}: '{name}' is not available on this machine "
                        f"(the accelerator here: {acc.type if acc is not None else 'none'})")
    index = int(os.environ.get("LOCAL_RANK", 0)) if device.index is None else device.index
    count = torch.accelerator.device_count()
    if not 0 <= index < count:
        raise UserError(f"{source}: {device.type}:{index} is not available: this machine has "
                        f"{count} {device.type} device(s)" + (" (torchrun starts one rank per device: "
                        "--nproc_per_node at most the device count)" if device.index is None else ""))
    device = torch.device(device.type, index)
    torch.accelerator.set_device_index(index)
    return device


def _known_device_types() -> str:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "cpu" + (f" and {acc.type}" if acc is not None else "")


# Process-group backends that take `init_process_group(device_id=...)`, binding the rank to its
# device and connecting eagerly. A plugin backend (a vendor's, or the test device's Python
# ProcessGroup) need not: c10d then fails with "No backend type associated with device type".
_BACKENDS_TAKING_DEVICE_ID = ("nccl", "xccl")


def dist_backend(device: torch.device) -> str:
    """Process-group backend for the device: gloo on CPU; elsewhere gloo for CPU tensors beside
    the backend the device registered (torch.distributed.Backend.default_device_backend_map)."""
    if device.type == "cpu":
        return "gloo"
    from torch.distributed import Backend

    backend = Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise UserError(f"several ranks on '{device.type}': no torch.distributed backend is registered "
                        f"for device type '{device.type}'; its extension must register one "
                        f"(torch.distributed.Backend.register_backend(name, creator, devices=['{device.type}']))")
    return f"cpu:gloo,{device.type}:{backend}"


def process_group_kwargs(device: torch.device, backend: str) -> dict:
    """Extra init_process_group arguments for `backend` on `device`: `device_id` only for the
    backends known to take it."""
    takes = [b for b in _BACKENDS_TAKING_DEVICE_ID if b in backend.split(",")[-1].split(":")]
    return {"device_id": device} if takes and device.type != "cpu" else {}


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@functools.cache
def compile_backend(device: torch.device) -> str:
    """torch.compile's backend for `device`: inductor where it has code generation for the device
    type (built in, or registered by the device's extension), else aot_eager (the graph is
    captured and run with the device's own kernels), with a warning."""
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()
    if get_scheduling_for_device(device.type) is not None:
        return "inductor"
    log.warning("parallelism.compile: inductor has no code generation for device type '%s'; compiling "
                "with the 'aot_eager' backend instead (graph capture without fused kernels)", device.type)
    return "aot_eager"


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The default generator's state of `device` (None on the CPU: torch.get_rng_state has it)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).get_rng_state(device)


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    torch.get_device_module(device.type).set_rng_state(state, device)


def is_host(device: torch.device | str) -> bool:
    """True when `device` (a torch.device or a device-type string such as `"cpu"`) is the host CPU:
    no accelerator allocator, no device stream, host RAM and host threads."""
    return (device if isinstance(device, str) else device.type) == "cpu"


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype commands use when none is asked for: float32 on the host CPU (where bf16 matrix
    products can be far slower; see warn_if_slow_bf16), bfloat16 on accelerators."""
    return torch.float32 if is_host(device) else torch.bfloat16
