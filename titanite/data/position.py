"""The loader position: what a checkpoint records of where the data stream is, and its checks.

Each training loader (loader.py, mixture.py, streaming.py) saves its position in the global
sample order as plain integers, tagged with its kind (untagged: a single prepared source's);
`check_position` refuses a position of another kind of loader or another data.seq_len.
`mix_seed` seeds the orders a position counts through (each epoch's permutation, a mixture's
draws), so a resumed run draws the same order.
"""

from __future__ import annotations

from typing import Any

from titanite.core.errors import UserError

_KINDS = {"packed": "one prepared source (data.path)", "mixture": "a mixture (data.sources)",
          "streaming": "a stream (data.streaming)"}


def check_position(state: dict[str, Any], kind: str, seq_len: int) -> None:
    """A checkpoint's loader position must be of this kind of loader and this data.seq_len
    (a position without a kind is a single prepared source's)."""
    found = state.get("kind", "packed")
    if found != kind:
        raise UserError(f"the checkpoint's data position is of {_KINDS.get(found, repr(found))}, but this run reads "
                        f"{_KINDS[kind]}; resume with the data settings the run was started with")
    if state.get("seq_len") != seq_len:
        raise UserError(f"data.seq_len is {seq_len} but the checkpoint was trained with {state.get('seq_len')}; "
                        "resume with the same data.seq_len")


def mix_seed(*parts: int) -> int:
    """One 64-bit generator seed per tuple (seed, epoch, ...); a golden-ratio multiply keeps
    nearby tuples apart. (seed, epoch) gives the single-source loader's epoch seeds."""
    h = parts[0]
    for p in parts[1:]:
        h = h * 0x9E3779B97F4A7C15 + p
    return h % 2**64
