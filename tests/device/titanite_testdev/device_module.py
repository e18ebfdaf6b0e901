"""`torch.tdev`: the device module PyTorch and its libraries look up by device type (FSDP2's
streams, DCP's writers, autocast, `torch.manual_seed`), as `torch.cuda` is for CUDA."""

from __future__ import annotations

import torch

from titanite_testdev import _C

_NAME = "tdev"


def is_available() -> bool:
    return _C.device_count() > 0


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def set_device(device) -> None:
    _C.set_device(_index(device))


class device:
    """Context manager making `device` the current one (torch.load moves storages with it)."""

    def __init__(self, device) -> None:
        self.index, self.previous = _index(device), -1

    def __enter__(self) -> None:
        self.previous = current_device()
        set_device(self.index)

    def __exit__(self, *exc) -> None:
        set_device(self.previous)


def get_device_name(device=None) -> str:
    return f"titanite test device {_index(device)}"


def synchronize(device=None) -> None:
    """Work on tdev runs synchronously: nothing is ever pending."""


class Stream(torch.Stream):
    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=torch.device(_NAME, _index(device)), priority=priority, **kwargs)


class Event(torch.Event):
    def __new__(cls, enable_timing: bool = False, **kwargs):
        return super().__new__(cls, device=torch.device(_NAME, current_device()), enable_timing=enable_timing)


def current_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device(_NAME, _index(device)))


def default_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device(_NAME, _index(device)))


def stream(s: torch.Stream | None):
    """Context manager making `s` the current stream (a no-op for None, as torch.cuda.stream)."""
    import contextlib

    return s if s is not None else contextlib.nullcontext()


def set_stream(s: torch.Stream) -> None:
    torch.accelerator.set_stream(s)


# ---- random number generation: each device has its own default generator --------------------

default_generators = tuple(_C.default_generator(i) for i in range(_C.device_count()))


def get_rng_state(device="tdev") -> torch.Tensor:
    return default_generators[_index(device)].get_state()


def set_rng_state(new_state: torch.Tensor, device="tdev") -> None:
    default_generators[_index(device)].set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators]


def set_rng_state_all(states) -> None:
    for g, s in zip(default_generators, states, strict=True):
        g.set_state(s)


def manual_seed(seed: int) -> None:
    default_generators[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    default_generators[current_device()].seed()


def seed_all() -> None:
    for g in default_generators:
        g.seed()


def initial_seed() -> int:
    return default_generators[current_device()].initial_seed()


# ---- autocast ---------------------------------------------------------------------------------

def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True
