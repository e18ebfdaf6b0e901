"""`python -m titanite_testdev.run -m tests.device_rng_check FOLDER [--without-device-restore]`:
a checkpoint saved on tdev restores the device's own generator, so the draws after a resume are
the draws the run would have made (the CPU generator is restored beside it). Exits 0 when they
are, 1 when not. `--without-device-restore` turns titanite's device restore off, to show that
the check can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from titanite.checkpoint import saving, training_state


def main(folder: Path) -> int:
    model = torch.nn.Linear(4, 4).to("tdev")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4, device="tdev")).sum().backward()
    optimizer.step()
    torch.manual_seed(7)
    torch.rand(3, device="tdev")  # a generator part-way through its stream
    path = saving.save(folder, 1, model, optimizer, {"data": {}}, "", keep_latest=0)
    expected = (torch.rand(5, device="tdev").cpu(), torch.rand(5))  # what a resumed run must draw
    torch.rand(100, device="tdev"), torch.rand(100)  # the run goes on, then dies
    training_state.load(path, model, optimizer)
    got = (torch.rand(5, device="tdev").cpu(), torch.rand(5))
    same = [torch.equal(a, b) for a, b in zip(got, expected, strict=True)]
    print(f"tdev draws after resume equal: {same[0]}; cpu draws equal: {same[1]}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    if "--without-device-restore" in sys.argv:
        from titanite import device

        device.set_rng_state = lambda *args: None
    sys.exit(main(Path(sys.argv[1])))
