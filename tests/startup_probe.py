"""Start a trainer (1 process, or one rank of a torchrun job), measure its start-up, export.

    python -m tests.startup_probe REPORT_DIR [train overrides...]
    python -m tests.startup_probe --step REPORT_DIR [train overrides...]   (a step's peak: step_main)

Each rank writes REPORT_DIR/rank-<r>.json with what it measured while it materialised:
- `read`: bytes of tensor data the checkpoint reader handed back, counted by a wrapper around
  safetensors' `safe_open` (its get_tensor and get_slice results), not taken from titanite's plan;
- `peak`: the peak of live bytes allocated by torch while `_materialize` ran, from the
  profiler's allocation events (the checkpoint files' memory maps left out);
- `local`: bytes of this rank's parameters and buffers once materialised;
- `largest`: bytes of the largest tensor of the Hugging Face layout.
Then every rank takes part in `Trainer.export(REPORT_DIR / "hf")`, which rank 0 writes: the
weights as initialised or loaded, before any step;
- `export_peak`: the peak of live bytes allocated while the export ran (the same way).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from titanite.core.config import load_config
from titanite.formats import safetensors_io
from titanite.formats.sharded import local_part
from titanite.parallel.distributed import exit_process
from titanite.run.trainer import Trainer


class _Counted:
    """A safetensors handle (or slice) whose returned tensors are counted."""

    def __init__(self, inner, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self._counter[0] += t.numel() * t.element_size()
        return t

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._count(self._inner.get_tensor(key))

    def get_slice(self, key: str):
        return _Counted(self._inner.get_slice(key), self._counter)

    def __getitem__(self, index) -> torch.Tensor:
        return self._count(self._inner[index])

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _peak_live_bytes(prof, mapped: set[int]) -> int:
    """Peak live bytes from the profiler's allocation events. safetensors maps each checkpoint
    file as one private, lazily paged storage (`mapped`: the file sizes): address space, not
    memory, so those are left out; what is copied out of them is counted."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu" and not (
                node.parent is None and abs(node.extra_fields.alloc_size) in mapped):
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def _profiled() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def main(report: Path, overrides: list[str]) -> None:
    read = [0]
    real_open = safetensors_io.safe_open
    safetensors_io.safe_open = lambda *a, **k: _Counted(real_open(*a, **k), read)
    measured: dict[str, int] = {}
    materialize = Trainer._materialize

    def probed(self, weights, resuming):
        with _profiled() as prof:
            materialize(self, weights, resuming)
        mapped = {p.stat().st_size for p in Path(self.cfg.model.hf_path).glob("*.safetensors")}
        measured["peak"] = _peak_live_bytes(prof, mapped)

    Trainer._materialize = probed
    trainer = Trainer(load_config(None, overrides))
    try:
        tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
        local = sum(local_part(t).numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
        largest = max(t.numel() * t.element_size() for _, t in trainer.handle.hf_state_dict(lambda _, t, indices: (
            torch.empty(t.shape, dtype=t.dtype, device="meta")[i] for i in indices)))
        report.mkdir(parents=True, exist_ok=True)
        with _profiled() as prof:
            trainer.export(report / "hf")
        measured["export_peak"] = _peak_live_bytes(prof, set())
        (report / f"rank-{trainer.rank}.json").write_text(json.dumps(
            {"read": read[0], "local": local, "largest": largest, **measured}))
    finally:
        trainer.close()
    trainer.world.close()


def live_state_bytes(trainer: Trainer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state as they are now."""
    seen: dict[int, torch.Tensor] = {}
    for p in trainer.model.parameters():
        seen[id(p)] = local_part(p)
        if p.grad is not None:
            seen[id(p.grad)] = local_part(p.grad)
    for state in trainer.optimizer.state.values():
        seen.update({id(v): local_part(v) for v in state.values() if torch.is_tensor(v)})
    return sum(t.numel() * t.element_size() for t in seen.values())


def step_main(report: Path, overrides: list[str]) -> None:
    """`--step`: one untimed training step (it creates the optimizer state), then a second under
    the profiler; REPORT_DIR/step-<r>.json gets `peak`, the most bytes torch held at once during
    that step: what was live as it began (the states) plus the peak of its allocation events."""
    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.train_step().read()
        trainer.step += 1
        before = live_state_bytes(trainer)
        with _profiled() as prof:
            trainer.train_step().read()
        report.mkdir(parents=True, exist_ok=True)
        (report / f"step-{trainer.rank}.json").write_text(json.dumps(
            {"peak": before + _peak_live_bytes(prof, set()), "before": before}))
    finally:
        trainer.close()
    trainer.world.close()


if __name__ == "__main__":
    if sys.argv[1] == "--step":
        step_main(Path(sys.argv[2]), sys.argv[3:])
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
    exit_process(0)  # as titanite's commands end a rank: no finalisation that could abort it
