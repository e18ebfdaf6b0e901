"""Kernel implementations side by side, and the chunked loss's peak memory: the tables in the
"Kernels" section of docs/performance.md.

    .venv/bin/python benchmarks/kernels.py                   # both tables, markdown, CPU
    .venv/bin/python benchmarks/kernels.py --only loss-memory --tokens 4096 --hidden 2048

Timing: `titanite kernels bench` (titanite/kernels/bench.py) on this machine's device, fp32 on
CPU, bf16 on an accelerator. Loss memory: each implementation of the `loss` op runs forward +
backward once in a fresh process on [tokens, hidden] states and a [151936, hidden] head (Qwen3's
vocabulary); the table gives the peak memory above what the inputs already hold. On CPU that is
the process's peak resident set size (reset just before the call) minus its size then (the
allocator returns large blocks to the OS, so transient buffers count); on an accelerator, the device allocator's
peak. The [tokens, 151936] fp32 logits alone are tokens x 0.58 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

_CHILD = r"""
import json, sys, torch
from titanite.device.choice import synchronize
from titanite.device.memory import reset_peak_memory
from titanite.kernels import implementations
impl, n, h, v, device, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
torch.manual_seed(0)
dev = torch.device(device)
dt = getattr(torch, dtype)
hidden = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
weight = (torch.randn(v, h, device=dev, dtype=dt) * 0.02).requires_grad_()
labels = torch.randint(0, v, (n,), device=dev)
fn = implementations("loss")[impl].fn
# Warm up on tiny inputs: first calls import code (e.g. torch._dynamo for custom ops) that RSS counts.
fn(hidden[:2].detach().requires_grad_(), weight[:64].detach().requires_grad_(), labels[:2] % 64).backward()
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
synchronize(dev)
reset_peak_memory(dev)
if dev.type == "cpu":
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size (VmHWM) to the current one
base_rss = status("VmRSS")
base_dev = torch.accelerator.memory_allocated(dev) if dev.type != "cpu" else 0
loss = fn(hidden, weight, labels)
loss.backward()
synchronize(dev)
if dev.type == "cpu":
    peak = status("VmHWM") - base_rss
else:
    peak = torch.accelerator.max_memory_allocated(dev) - base_dev
print(json.dumps({"impl": impl, "peak_bytes": peak, "loss": float(loss)}))
"""


def loss_memory(tokens: int, hidden: int, vocab: int, device: str, dtype: str) -> list[dict]:
    rows = []
    for impl in ("reference", "chunked"):
        out = subprocess.run([sys.executable, "-c", _CHILD, impl, str(tokens), str(hidden), str(vocab), device, dtype],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("bench", "loss-memory"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    import torch

    from titanite.kernels import bench, load_plugins

    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {args.device}\n")
    if args.only in (None, "bench"):
        load_plugins([])
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        print(bench.format_table(bench.bench(device=args.device, dtype=dtype)) + "\n")
    if args.only in (None, "loss-memory"):
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        rows = loss_memory(args.tokens, args.hidden, args.vocab, args.device, dtype)
        logits_mib = args.tokens * args.vocab * 4 / 2**20
        print(f"loss op, forward + backward, {args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, "
              f"{dtype} (fp32 logits would be {logits_mib:.0f} MiB)\n")
        print("| implementation | peak memory above inputs | loss |\n| --- | --- | --- |")
        for r in rows:
            print(f"| {r['impl']} | {r['peak_bytes'] / 2**20:.0f} MiB | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
