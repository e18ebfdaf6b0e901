"""Long packed sequences on one rank: the `sdpa` attention builds no [S, S] mask.

Packed documents go span by span (titanite/kernels/torch_impls.py, `document_spans`): one causal
call per long document, short documents grouped with a mask of the group's size. The results
must be the reference's (block-causal softmax attention over the whole row), forward and
backward, and no tensor allocated during a forward and backward may be as large as an [S, S]
bool mask, where the old path (one block_causal_mask for the whole row) allocates one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, make_hf_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import titanite
from titanite.kernels import block_causal_mask
from titanite.kernels.reference_ops import attention as reference
from titanite.kernels.torch_impls import document_spans, sdpa


def documents(*rows: list[int]) -> torch.Tensor:
    """int64 [len(rows), S]: row r holds documents of the lengths rows[r], ids 0, 1, ..."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in rows])


def random_lengths(total: int, longest: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), total - sum(lengths)))
    return lengths


def qkv(B: int, Hq: int, Hk: int, S: int, D: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g).requires_grad_() for h in (Hq, Hk, Hk)]


def forward_backward(fn, q, k, v, docs) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v for a fixed random upstream gradient."""
    out = fn(q, k, v, q.shape[-1] ** -0.5, docs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), (q, k, v))]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


S_SMALL = 700
LAYOUTS = {
    # name: (document ids [B, S], heads (Hq, Hk))
    "many short documents": (documents(random_lengths(S_SMALL, 20, seed=1)), (4, 4)),
    "few long documents": (documents([400, 290, 10]), (4, 4)),
    "a row with padding": (documents([100, 3, 250, 7, 300 - 3 - 7, 40]), (4, 4)),  # the last block: padding
    "B=2, different layouts": (documents([650, 50], random_lengths(S_SMALL, 30, seed=2)), (4, 4)),
    "GQA 8:2, long and short documents": (documents([300] + random_lengths(S_SMALL - 300, 12, seed=3)), (8, 2)),
    "one document": (documents([S_SMALL]), (4, 2)),
    # Not what packing makes, but the op's contract allows it: an id that comes back later.
    "ids that come back": (torch.tensor([[0] * 30 + [1] * 20 + [0] * 10 + [2] * 640]), (4, 2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_sdpa_matches_the_reference(layout):
    docs, (Hq, Hk) = LAYOUTS[layout]
    q, k, v = qkv(docs.shape[0], Hq, Hk, docs.shape[1])
    got = forward_backward(sdpa, q, k, v, docs)
    want = forward_backward(reference, q, k, v, docs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative(a, b) <= 1e-5, (layout, name, relative(a, b))


def test_spans_cover_whole_documents():
    """Long documents alone and causal; short ones grouped (masked) up to the group size; a
    returning id keeps everything between it and its first run in one masked span."""
    docs = documents([300, 5, 7, 88, 400], [1] * 260 + [540])
    assert document_spans(docs, group_tokens=256) == [((300, True), (100, False), (400, True)),
                                                      ((256, False), (4, False), (540, True))]
    back = torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]])
    assert document_spans(back, group_tokens=2) == [((5, False), (3, True))]


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) of any tensor an op returns: what was allocated, not
    the size of a broadcast view."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.where = t.untyped_storage().nbytes(), (str(func), tuple(t.shape), t.dtype)
        return out


def largest_allocation(fn) -> LargestAllocation:
    with LargestAllocation() as mode:
        fn()
    return mode


def old_packed_sdpa(q, k, v, scale, docs):
    """The packed path before: one block-causal mask for the whole row."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(docs), scale=scale, enable_gqa=True)


S_LONG = 4096
LONG_LAYOUTS = {"many documents": random_lengths(S_LONG, 64, seed=4), "few documents": [2048, 1500, 548]}


@pytest.mark.parametrize("layout", list(LONG_LAYOUTS))
def test_no_tensor_of_s_squared_at_s_4096(layout):
    """Forward and backward at S = 4096: nothing allocated reaches S * S bytes (an [S, S] bool
    mask); the old path allocates at least that, so the check can fail."""
    docs = documents(LONG_LAYOUTS[layout])
    q, k, v = qkv(1, 4, 2, S_LONG)
    new = largest_allocation(lambda: forward_backward(sdpa, q, k, v, docs))
    assert new.nbytes < S_LONG * S_LONG, new.where
    assert new.nbytes <= q.numel() * 4, new.where  # nothing larger than q itself, in fact
    if layout == "many documents":
        old = largest_allocation(lambda: forward_backward(old_packed_sdpa, q, k, v, docs))
        assert old.nbytes >= S_LONG * S_LONG, old.where


def test_plain_causal_path_builds_no_mask():
    q, k, v = qkv(1, 4, 2, S_LONG)
    causal = largest_allocation(lambda: forward_backward(lambda *a: sdpa(*a[:4]), q, k, v, None))
    assert causal.nbytes <= q.numel() * 4, causal.where


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
def test_models_build_no_s_squared_mask_for_packed_documents(tmp_path, spec):
    """A training forward and backward of either backend (native; transformers with titanite's
    kernels installed, which receives the document ids) at S = 4096 with many documents."""
    from titanite.kernels.hf import install

    folder = make_hf_checkpoint(tmp_path / "m")
    model = titanite.load_pretrained(folder, spec=spec)
    if spec == "hf":
        install(model.hf)
    lengths = LONG_LAYOUTS["many documents"]
    docs = documents(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, TINY_VOCAB, (1, S_LONG), generator=torch.Generator().manual_seed(5))

    def step():
        model(ids, pos, document_ids=docs).float().square().mean().backward()

    mode = largest_allocation(step)
    assert mode.nbytes < S_LONG * S_LONG, mode.where
