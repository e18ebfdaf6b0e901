"""What benchmarks/long_context.py runs in its child processes (not a script of its own).

- `rank(argv)`: one rank of a training run: titanite.train's main with the rank's VmHWM (the
  kernel's high-water mark of the resident set, exact) read when the end-of-run save begins
  (through the training steps) and at exit; one JSON file per rank in $TITANITE_LC_RECORD.
  `argv == ["--baseline"]`: a process that only imports titanite.run.trainer, the floor under
  every rank.
- `gather_share(argv)`: run under torch.distributed.run on 2 (or more) gloo ranks: for one
  attention layer's shapes, the all-gather of the keys and values over the ranks against the
  attention of the rank's two query chunks over their key prefixes, forward + backward each,
  and the two together as the trainer runs them (titanite.kernels.context_parallel.wrap around
  titanite.kernels.torch_impls.sdpa under `context_parallel.active(Layout(...))`). Rank 0
  prints one JSON line per sequence length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import train_and_record, write_baseline

RECORD_ENV = "TITANITE_LC_RECORD"


# -- one training rank --------------------------------------------------------------------------


def rank(argv: list[str]) -> None:
    if write_baseline(argv, RECORD_ENV):
        return
    record = Path(os.environ[RECORD_ENV])
    me = int(os.environ.get("RANK", "0"))
    train_and_record(argv, {}, record, me)


# -- the gather's share of a layer's attention ---------------------------------------------------


def gather_share(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", type=int, nargs="+", required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from titanite.kernels import context_parallel
    from titanite.kernels.context_parallel import Layout, gather_sequence
    from titanite.kernels.torch_impls import sdpa
    from titanite.parallel.context import GroupCollectives

    dist.init_process_group("gloo")
    me, cp = dist.get_rank(), dist.get_world_size()
    group = GroupCollectives(dist.group.WORLD)
    attention = context_parallel.wrap(sdpa)
    B, Hq, Hk, D = args.batch, args.heads, args.kv_heads, args.head_dim
    scale = D ** -0.5

    def timed(fns: dict) -> dict[str, list[float]]:
        """Seconds of each call after one untimed call of each, the slowest rank's (every call ends
        with a barrier, so a rank's time includes waiting for the others, as in a training step).
        The calls alternate (gather, attention, layer, gather, ...), so a neighbour's load on this
        shared machine falls on all three alike."""
        for fn in fns.values():
            fn()
        out: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                dist.barrier()
                t = time.perf_counter()
                fn()
                dist.barrier()
                t = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                out[name].append(float(t))
        return out

    for S in args.seq_lens:
        torch.manual_seed(me)
        layout = Layout(group, cp, me, S)
        local = S // cp
        q = torch.randn(B, Hq, local, D, requires_grad=True)
        k = torch.randn(B, Hk, local, D, requires_grad=True)
        v = torch.randn(B, Hk, local, D, requires_grad=True)
        grad_out = torch.randn(B, Hq, local, D)
        grad_k, grad_v = torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
        keys = torch.randn(B, Hk, S, D, requires_grad=True)  # the gathered keys and values, for compute alone
        values = torch.randn(B, Hk, S, D, requires_grad=True)

        def gather() -> None:  # forward: two all-gathers; backward: two reduce-scatters
            kk, vv = gather_sequence(k, layout), gather_sequence(v, layout)
            torch.autograd.backward([kk, vv], [grad_k, grad_v])

        def compute() -> None:  # the wrapper's loop over the two query chunks, on keys already gathered
            c = layout.chunk
            outs = [sdpa(q[:, :, j * c:(j + 1) * c], keys[:, :, :end], values[:, :, :end], scale)
                    for j, end in enumerate(layout.chunk_ends())]
            torch.cat(outs, dim=2).backward(grad_out)

        def layer() -> None:  # both, as a training step runs them
            with context_parallel.active(layout):
                out = attention(q, k, v, scale)
            out.backward(grad_out)

        times = timed({"gather": gather, "compute": compute, "layer": layer})
        for t in (q, k, v, keys, values):
            t.grad = None
        if me == 0:
            med = {name: statistics.median(ts) for name, ts in times.items()}
            print(json.dumps({"seq_len": S, "cp": cp, "threads": torch.get_num_threads(),
                              "gathered_bytes": 2 * B * Hk * S * D * 4, **{f"{k}_s": v for k, v in med.items()},
                              "all": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "--rank":
        rank(sys.argv[2:])
    elif sys.argv[1] == "--gather-share":
        gather_share(sys.argv[2:])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
