"""Reliability of checkpoints (faults 1 to 3 of docs/reliability.md).

1. Loading a checkpoint runs no code from it: a malicious `.metadata` is refused on every load
   path, the restricted unpickler reads genuine metadata as pickle does, and pickled byte entries
   are refused.
2. A run that goes non-finite never saves the bad weights: the last good checkpoint stays, a NaN
   loss between log steps has its update skipped, and an infinite learning rate is refused.
3. A corrupt newest checkpoint is passed over for the one before it, a run with none usable stops
   with one message, a checkpoint of another model names the key and both shapes, and
   keep_latest prunes only after the new save.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.conftest import TINY_VOCAB, make_hf_checkpoint, read_metrics, tiny_train_args
from tests.fixtures.reliability import (
    _corrupt_flip,
    _corrupt_garbage_with_manifest,
    _corrupt_truncate,
    losses,
    refused,
    rewrite_manifest,
    titanite,
    train,
)
from titanite.checkpoint import training_state
from titanite.formats.dcp_safe import RestrictedUnpickler, read_metadata

pytest_plugins = ["tests.fixtures.reliability"]


# 1. Loading a checkpoint runs code from it ---------------------------------------------------


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_1_malicious_metadata_runs_no_code(tmp_path, capsys, reference):
    hf, data, _ = reference
    out, marker = tmp_path / "run", tmp_path / "PWNED"
    assert train(capsys, hf, data, out, steps=2)[0] == 0
    ckpt = out / "checkpoints" / "step-2"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rewrite_manifest(ckpt)
    for argv in (["train", *tiny_train_args(hf, data, out, steps=4)],
                 ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "exp")],
                 ["generate", "--model", str(out), "--prompt", "hi", "--max-new-tokens", "2"],
                 ["checkpoint", "verify", str(ckpt)]):
        code, err = titanite(capsys, *argv)
        assert code == 2, (argv, err[-2000:])
        assert "posix.system" in err and "refused" in err, err[-2000:]
        assert not marker.exists(), argv
    assert not (tmp_path / "exp").exists()
    assert max(r["step"] for r in read_metrics(out)) == 2  # nothing trained or logged past the refusal


def test_1_restricted_unpickler_reads_real_metadata_like_pickle(tmp_path, capsys, reference):
    """Oracle: plain pickle.load of a genuine DCP .metadata file."""
    hf, data, _ = reference
    assert train(capsys, hf, data, tmp_path / "run", steps=2)[0] == 0
    path = tmp_path / "run" / "checkpoints" / "step-2" / ".metadata"
    with open(path, "rb") as f:
        ours = RestrictedUnpickler(f, str(path)).load()
    with open(path, "rb") as f:
        theirs = pickle.load(f)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_1_pickled_byte_entries_are_refused(tmp_path):
    """DCP stores non-tensors as torch.save bytes and its default planner unpickles them with no
    restriction; titanite refuses such an entry instead."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": _Payload(tmp_path / "PWNED")}}, checkpoint_id=str(ckpt), no_dist=True)
    from titanite.formats.dcp_safe import UnsafeCheckpoint, check_compatible

    with pytest.raises(UnsafeCheckpoint, match="pickled bytes"):
        check_compatible(read_metadata(ckpt), {"model": {"w": torch.zeros(2)}}, ckpt)
    assert not (tmp_path / "PWNED").exists()


# 2. A NaN run is saved as the last good checkpoint -------------------------------------------


@pytest.mark.parametrize("async_mode", ["off", "async"])
def test_2_nonfinite_weights_are_never_saved(tmp_path, capsys, reference, monkeypatch, async_mode):
    """With async saves too: the check runs in the step, before the state is staged, and the run
    stops only after the save in flight (finite) has landed."""
    from titanite.core.config import ModelConfig, TrainingConfig
    from titanite.models.spec import get_spec
    from titanite.run.optim import param_groups

    hf, data, want = reference
    model = get_spec("qwen3").build(ModelConfig(hf_path=str(hf))).module
    names = {id(p): n for n, p in model.named_parameters()}
    poisoned_name = names[id(param_groups(model, TrainingConfig())[0]["params"][1])]
    out = tmp_path / "run"
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def poisoned_step(self, *a, **kw):  # the update of step 3 overflows one weight
        result = real_step(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][1].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    extra = {"checkpoint.interval": 1, "checkpoint.keep_latest": 1, "checkpoint.async_mode": async_mode}
    code, err = train(capsys, hf, data, out, **extra)
    assert code == 3, err[-2000:]
    assert "after the update of step 3" in err and f"first non-finite tensor: {poisoned_name}" in err, err[-2000:]
    assert "Last good checkpoint: " + str(out / "checkpoints" / "step-2") in err, err[-2000:]
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    (step, ckpt), = training_state.list_checkpoints(out / "checkpoints")
    assert step == 2 and training_state.verify(ckpt) == []
    assert train(capsys, hf, data, out, **extra)[0] == 0  # resumes from the finite step-2
    assert losses(out) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_2_the_finite_check_sees_every_nan_and_inf(dtype):
    """The host's check (min and max of each tensor) against torch.isfinite, element by element:
    one NaN, +Inf or -Inf anywhere in any tensor, or none."""
    from titanite.checkpoint.finite import all_finite

    gen = torch.Generator().manual_seed(0)
    for bad in (float("nan"), float("inf"), float("-inf"), None):
        for _ in range(5):
            ts = [torch.randn(int(n), generator=gen).to(dtype) for n in torch.randint(1, 5000, (4,), generator=gen)]
            if bad is not None:
                t = ts[int(torch.randint(0, 4, (), generator=gen))]
                t[int(torch.randint(0, t.numel(), (), generator=gen))] = bad
            assert bool(all_finite(ts)) == all(bool(torch.isfinite(t).all()) for t in ts), (dtype, bad)


def test_2_nonfinite_loss_between_log_steps_skips_its_update_on_the_device(tmp_path, reference, monkeypatch):
    """A NaN loss on a step that is not logged is not read there: its update is skipped on the
    device (weights stay finite), and the next log step stops the run, naming the first step."""
    from titanite.core.config import load_config
    from titanite.core.errors import TrainingDiverged
    from titanite.run.step_context import StepContext
    from titanite.run.trainer import Trainer

    hf, data, _ = reference
    real, seen = StepContext.forward, {"n": 0}

    def poisoned(self, batch):
        seen["n"] += 1
        out, loss = real(self, batch)
        return out, (loss * float("nan") if seen["n"] == 3 else loss)

    monkeypatch.setattr(StepContext, "forward", poisoned)
    trainer = Trainer(load_config(None, tiny_train_args(hf, data, tmp_path / "run", steps=6, **{
        "metrics.log_interval": 4, "checkpoint.interval": 2})))
    with pytest.raises(TrainingDiverged, match=r"loss is nan .* at step 3; its update was skipped.*step-2"):
        trainer.train()
    assert trainer.step == 4  # ran on to the logging step
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {3.0}  # steps 1, 2 and 4 were applied, 3 was not
    assert [s for s, _ in training_state.list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


def test_2_infinite_lr_is_refused_before_any_work(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    refused(*train(capsys, hf, data, out, **{"training.lr": "inf"}), "training.lr", "finite")
    assert not out.exists()


# 3. A corrupt or mismatched checkpoint crashes instead of falling back -----------------------


@pytest.mark.parametrize("corrupt, reason", [
    (_corrupt_flip, "SHA-256"), (_corrupt_truncate, "bytes, the manifest says"),
    (_corrupt_garbage_with_manifest, "cannot be loaded"),
])
def test_3_corrupt_newest_checkpoint_falls_back(tmp_path, capsys, reference, corrupt, reason):
    hf, data, want = reference
    out = tmp_path / "run"
    assert train(capsys, hf, data, out, steps=3, **{"checkpoint.interval": 1})[0] == 0
    corrupt(out / "checkpoints" / "step-3")
    code, err = titanite(capsys, "checkpoint", "verify", str(out))
    assert (code == 2) == (reason != "cannot be loaded"), err
    code, err = train(capsys, hf, data, out)  # resume: step-3 is unusable, step-2 is not
    assert code == 0, err[-2000:]
    assert "cannot use step-3" in err and reason in err, err[-2000:]
    assert losses(out) == want


def test_3_no_usable_checkpoint_stops_with_one_message(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    assert train(capsys, hf, data, out, steps=2)[0] == 0
    _corrupt_flip(out / "checkpoints" / "step-2")
    refused(*train(capsys, hf, data, out), "no usable checkpoint", "step-2", "SHA-256")
    assert [s for s, _ in training_state.list_checkpoints(out / "checkpoints")] == [2]  # kept for repair


def test_3_checkpoint_of_another_model_names_key_and_shapes(tmp_path, capsys, reference, tiny_tokenizer_dir):
    hf, data, _ = reference
    other = make_hf_checkpoint(tmp_path / "wide", tiny_tokenizer_dir, hidden_size=64)
    assert train(capsys, other, data, tmp_path / "wide-run", steps=2)[0] == 0
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    os.rename(tmp_path / "wide-run" / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    code, err = train(capsys, hf, data, out)
    refused(code, err, "model.tok_embeddings.weight", f"[{TINY_VOCAB}, 64]", f"[{TINY_VOCAB}, 48]")


def test_3_keep_latest_prunes_only_after_the_new_save_and_verify_command(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    assert train(capsys, hf, data, out, **{"checkpoint.interval": 1, "checkpoint.keep_latest": 2})[0] == 0
    assert [s for s, _ in training_state.list_checkpoints(out / "checkpoints")] == [3, 4]
    code, text = titanite(capsys, "checkpoint", "verify", str(out))
    assert code == 0 and text.count("hashes match") == 2, text
