"""Worker of tests/test_context_parallel.py, run by torchrun (gloo, CPU): `attention` or `memory`.

attention: each rank runs the context-parallel attention op on its chunks and prints its largest
    errors (output, dq, dk, dv) against the reference op on the whole sequence.
memory: each rank measures the bytes autograd keeps for the backward of one forward of a small
    native Qwen3 on its chunks of a 2048-token sequence, and the same for the whole sequence in
    one piece (no layout), and prints their ratio.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from titanite.kernels import context_parallel as C
from titanite.kernels.reference_ops import attention
from titanite.kernels.torch_impls import sdpa
from titanite.parallel.context import ContextParallel, GroupCollectives, apply, local_index


def check_attention(rank: int, cp: int) -> None:
    torch.manual_seed(0)
    B, Hq, Hk, S, D = 2, 4, 2, 64, 8
    q, k, v = (torch.randn(B, h, S, D, requires_grad=True) for h in (Hq, Hk, Hk))
    # documents of 5, 27 and 32 tokens / 40 and 24: every border falls inside a chunk
    docs = torch.tensor([[0] * 5 + [1] * 27 + [2] * 32, [0] * 40 + [1] * 24])
    idx = local_index(S, cp, rank)
    for name, ids in (("causal", None), ("packed", docs)):
        ref = attention(q, k, v, 0.3, ids)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        expected = [t.grad[:, :, idx].clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        with C.active(C.Layout(GroupCollectives(dist.group.WORLD), cp, rank, S, ids)):
            out = C.wrap(sdpa)(*local, 0.3, None if ids is None else ids[:, idx])
            out.backward(grad[:, :, idx])
        errors = [(out - ref[:, :, idx]).abs().max()] + [(t.grad - e).abs().max() for t, e in zip(local, expected)]
        report(f"attention {rank} {name} " + " ".join(f"{float(e):.3e}" for e in errors))


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `fn` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def check_memory(rank: int, cp: int) -> None:
    from titanite.models.qwen3.args import Qwen3Args
    from titanite.models.qwen3.model import Qwen3

    torch.manual_seed(0)
    a = Qwen3Args(vocab_size=256, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=8, num_kv_heads=2,
                  head_dim=16)
    model = Qwen3(a)
    model.init_buffers() if hasattr(model, "init_buffers") else None
    apply(model, "cpu", torch.float32)
    S = 2048
    ids = torch.randint(0, a.vocab_size, (1, S + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(S)[None]}

    def forward(b):
        return lambda: model(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"])

    whole = saved_bytes(forward(batch))
    splitter = ContextParallel(_WorldMesh(), S)
    local = splitter.split(batch)
    with splitter.micro_batch(local):
        mine = saved_bytes(forward(local))
    report(f"memory {rank} {whole} {mine} {mine / whole:.4f}")


class _WorldMesh:
    """The default group, as much of a DeviceMesh as ContextParallel reads."""

    def get_group(self):
        return dist.group.WORLD

    def size(self) -> int:
        return dist.get_world_size()

    def get_local_rank(self) -> int:
        return dist.get_rank()


def report(line: str) -> None:
    """Rank 0 prints every rank's line (gathered as bytes: the ranks' prints would interleave)."""
    from titanite.parallel.distributed import gather_texts

    lines = gather_texts(line)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"attention": check_attention, "memory": check_memory}[sys.argv[1]](dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
