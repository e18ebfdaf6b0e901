"""What the reliability tests share (one test per failure the fault review found, numbered as in
docs/reliability.md).

Each test builds its bad input itself and checks three things: the exit code, that the message
names the cause, and that nothing is lost (no file written on exit 2, the last good checkpoint
intact, resume reproducing the uninterrupted losses). Here: running the `titanite` command in
this process, the refusal check, the reference run (a tiny checkpoint, data, and the losses of an
uninterrupted 4-step run), the ways to break a saved checkpoint, and the comparison of two
runs' checkpoints tensor by tensor (these two also used by tests/test_device_runs.py).

`reference` is session-scoped and reaches the test files as a plugin: each reliability test file
names this module in `pytest_plugins`, so the reference run is trained once per session however
the tests are split across files.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import make_hf_checkpoint, read_metrics, tiny_train_args, write_corpus
from titanite import cli
from titanite.checkpoint import training_state
from titanite.core.files import file_digest
from titanite.formats import manifest


def titanite(capsys, *argv: str) -> tuple[int, str]:
    """Run the `titanite` command in this process: (exit code, what it printed)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def train(capsys, hf, data, out, steps=4, **extra) -> tuple[int, str]:
    return titanite(capsys, "train", *tiny_train_args(hf, data, out, steps=steps, **extra))


def losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def refused(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err[-3000:])


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny checkpoint, data, and the losses of an uninterrupted 4-step run (checkpoint every 2)."""
    root = tmp_path_factory.mktemp("reference")
    hf = make_hf_checkpoint(root / "hf", tiny_tokenizer_dir)
    data = write_corpus(root / "data.jsonl")
    out = root / "full"
    code = cli.main(["train", *tiny_train_args(hf, data, out, steps=4)])
    assert code == 0
    return hf, data, losses(out)


def rewrite_manifest(folder) -> None:
    """What an attacker who edits a checkpoint would also do: make the manifest match."""
    files = manifest.read(folder)
    manifest.write(folder, {name: file_digest(folder / name) for name in files}, int(folder.name[5:]))


def _corrupt_flip(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))


def _corrupt_truncate(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-64])


def _corrupt_garbage_with_manifest(ckpt):
    """Same-size garbage and a matching manifest: verification passes, DCP's load raises."""
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    rewrite_manifest(ckpt)


def checkpoint_tensors(folder, scratch) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read back whole by DCP's own converter."""
    dcp_to_torch_save(folder, scratch)
    flat: dict[str, torch.Tensor] = {}
    for section, tensors in torch.load(scratch, weights_only=True).items():
        flat.update({f"{section}/{k}": v for k, v in tensors.items()})
    return flat


def assert_same_checkpoints(sync_root, async_root, steps, scratch) -> None:
    for step in steps:
        a = checkpoint_tensors(sync_root / f"step-{step}", scratch / f"sync-{step}.pt")
        b = checkpoint_tensors(async_root / f"step-{step}", scratch / f"async-{step}.pt")
        assert a.keys() == b.keys(), step
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)
        assert training_state.verify(async_root / f"step-{step}") == []
