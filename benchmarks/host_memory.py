"""What keeping freed host memory is worth on CPU: the demo's shapes, with and without it.

glibc returns every freed allocation above its mmap threshold to the OS, so a training step
that allocates and frees the same large tensors faults (and the kernel zeroes) every page again
each step. A single CPU process keeps freed memory; ranks that share a host return it
(titanite.device.memory.set_host_memory_policy); `TITANITE_KEEP_FREED_MEMORY=1` / `=0` force keep /
return, which this compares. Each setting runs in its own process:
two native trainers at the demo's shapes (debug flavor, 4 x 256 tokens, 151,936 tied vocab),
`loss = "reference"` and `"chunked"`, alternating one step each (one untimed, then --steps timed).

    .venv/bin/python benchmarks/host_memory.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import backends  # noqa: E402  (the same model folder and trainers as benchmarks/backends.py)
import torch  # noqa: E402

DEMO = dict(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, vocab=151936, tied=True, batch_size=4,
            seq_len=256, compile=False, threads=1)


def child(steps: int) -> None:
    torch.set_num_threads(1)
    logging.getLogger("titanite").setLevel(logging.WARNING)
    args = argparse.Namespace(**DEMO)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = backends.make_model_folder(root, args)
        rows = {loss: backends.titanite_step(backends.titanite_trainer("qwen3", folder, root, "fp32", args,
                                                                       **{"kernels.loss": loss}))
                for loss in ("reference", "chunked")}
        times: dict[str, list[float]] = {loss: [] for loss in rows}
        for step in rows.values():
            step()
        for _ in range(steps):
            for loss, step in rows.items():
                start = time.perf_counter()
                step()
                times[loss].append(time.perf_counter() - start)
    print(json.dumps(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.steps)
        return
    results = {}
    for setting in ("0", "1"):
        env = {**os.environ, "TITANITE_KEEP_FREED_MEMORY": setting, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)], env=env,
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[setting] = json.loads(out)
    print("| loss | s/step, freed memory returned (min / median) | s/step, freed memory kept (min / median) "
          "| speed-up (min) |")
    print("| --- | ---: | ---: | ---: |")
    for loss in ("reference", "chunked"):
        off, on = sorted(results["0"][loss]), sorted(results["1"][loss])
        print(f"| {loss} | {off[0]:.2f} / {off[len(off) // 2]:.2f} | {on[0]:.2f} / {on[len(on) // 2]:.2f} | "
              f"{off[0] / on[0]:.2f}x |")


if __name__ == "__main__":
    main()
