"""Trustworthy runs: one test per failure the fault review found (numbered as in docs/reliability.md).

Each builds its bad input here and checks three things: the exit code, that the message names
the cause, and that nothing is lost (no file written on exit 2, the last good checkpoint intact,
resume reproducing the uninterrupted losses).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titanite import cli
from titanite.checkpoint import manifest, training_state
from titanite.checkpoint.dcp_safe import RestrictedUnpickler, read_metadata
from titanite.checkpoint.safetensors_io import HFReader
from titanite.errors import UserError
from titanite.files import file_digest
from titanite.runlock import RunLock
from tests.conftest import REPO, TINY_VOCAB, make_hf_checkpoint, read_metrics, tiny_train_args, write_corpus


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny checkpoint, data, and the losses of an uninterrupted 4-step run (checkpoint every 2)."""
    root = tmp_path_factory.mktemp("reference")
    hf = make_hf_checkpoint(root / "hf", tiny_tokenizer_dir)
    data = write_corpus(root / "data.jsonl")
    out = root / "full"
    code = cli.main(["train", *tiny_train_args(hf, data, out, steps=4)])
    assert code == 0
    return hf, data, losses(out)


def copy_of(hf, folder, skip_suffix: str = ""):
    """A copy of the reference checkpoint folder, to break."""
    folder.mkdir()
    for f in hf.iterdir():
        if not skip_suffix or f.suffix != skip_suffix:
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def edit_config(folder, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_manifest(folder) -> None:
    """What an attacker who edits a checkpoint would also do: make the manifest match."""
    files = manifest.read(folder)
    manifest.write(folder, {name: file_digest(folder / name) for name in files}, int(folder.name[5:]))


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
    from titanite.checkpoint.dcp_safe import UnsafeCheckpoint, check_compatible

    with pytest.raises(UnsafeCheckpoint, match="pickled bytes"):
        check_compatible(read_metadata(ckpt), {"model": {"w": torch.zeros(2)}}, ckpt)
    assert not (tmp_path / "PWNED").exists()


# 2. A NaN run is saved as the last good checkpoint -------------------------------------------


def test_2_nonfinite_weights_are_never_saved(tmp_path, capsys, reference, monkeypatch):
    from titanite.config import ModelConfig, TrainingConfig
    from titanite.models.spec import get_spec
    from titanite.optim import param_groups

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
    code, err = train(capsys, hf, data, out, **{"checkpoint.interval": 1, "checkpoint.keep_latest": 1})
    assert code == 3, err[-2000:]
    assert "after the update of step 3" in err and f"first non-finite tensor: {poisoned_name}" in err, err[-2000:]
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    (step, ckpt), = training_state.list_checkpoints(out / "checkpoints")
    assert step == 2 and training_state.verify(ckpt) == []
    assert train(capsys, hf, data, out)[0] == 0  # resumes from the finite step-2
    assert losses(out) == want


def test_2_nonfinite_loss_between_log_steps_skips_its_update_on_the_device(tmp_path, reference, monkeypatch):
    """A NaN loss on a step that is not logged is not read there: its update is skipped on the
    device (weights stay finite), and the next log step stops the run, naming the first step."""
    from titanite.config import load_config
    from titanite.errors import TrainingDiverged
    from titanite.trainer import Trainer

    hf, data, _ = reference
    real, seen = Trainer._forward, {"n": 0}

    def poisoned(self, batch):
        seen["n"] += 1
        out, loss = real(self, batch)
        return out, (loss * float("nan") if seen["n"] == 3 else loss)

    monkeypatch.setattr(Trainer, "_forward", poisoned)
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


# 4. model.safetensors.index.json can point outside the folder --------------------------------


@pytest.mark.parametrize("shard", ["../../outside.safetensors", "/etc/passwd", "link.safetensors"])
def test_4_index_entries_stay_inside_the_folder(tmp_path, tiny_tokenizer_dir, shard):
    hf = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir)
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    outside = tmp_path / "elsewhere.safetensors"
    save_file(tensors, outside, metadata={"format": "pt"})
    if shard == "link.safetensors":
        (hf / "link.safetensors").symlink_to(outside)
    weight_map = {k: shard for k in tensors}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match="outside"):
        HFReader(hf)


def test_4_hub_cache_snapshot_links_are_followed(tmp_path, tiny_tokenizer_dir):
    """The one allowed link out: a hub-cache snapshot's files point into the repo's blobs/."""
    src = make_hf_checkpoint(tmp_path / "src", tiny_tokenizer_dir)
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    with HFReader(snap) as reader:
        assert torch.equal(reader.get("model.norm.weight"), load_file(src / "model.safetensors")["model.norm.weight"])


# 5. Token ids are not checked against the vocabulary -----------------------------------------


def test_5_tokenizer_ids_beyond_the_vocabulary(tmp_path, capsys, reference):
    from tokenizers import Tokenizer

    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(TINY_VOCAB)])  # ids run past vocab_size
    tok.save(str(folder / "tokenizer.json"))
    largest = tok.get_vocab_size(with_added_tokens=True) - 1  # ids are dense here
    assert largest >= TINY_VOCAB
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), f"up to {largest}", f"vocab_size is {TINY_VOCAB}")
    assert not out.exists()


# 6. Two runs can share one output_dir --------------------------------------------------------


def test_6_second_run_on_a_held_folder_exits_at_once(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    held = RunLock(out).acquire()  # a live run holds the folder
    try:
        refused(*train(capsys, hf, data, out), "in use by another titanite run", f"pid {os.getpid()}",
                socket.gethostname())
        assert sorted(p.name for p in out.iterdir()) == [".titanite.lock"]
    finally:
        held.release()


def test_6_ranks_of_the_holding_job_pass_the_preflight_check(tmp_path, monkeypatch):
    """A rank whose preflight runs after its own rank 0 took the lock is not a second run; a
    process of another torchrun job, or of none, still is."""
    from titanite.errors import UserError
    from titanite.runlock import check_free

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    held = RunLock(tmp_path).acquire()
    try:
        check_free(tmp_path)
        for other in ("job-b", ""):
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
            with pytest.raises(UserError, match="in use by another titanite run"):
                check_free(tmp_path)
    finally:
        held.release()


def test_6_lock_of_a_killed_run_does_not_block(tmp_path, capsys, reference):
    hf, data, want = reference
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from titanite.runlock import RunLock; "
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / ".titanite.lock").exists()  # left behind by the kill
    assert train(capsys, hf, data, out)[0] == 0
    assert losses(out) == want
    assert not (out / ".titanite.lock").exists()


# 7. Nonsense config.json values are accepted ---------------------------------------------------


@pytest.mark.parametrize("key, value, fragment", [
    ("num_attention_heads", 0, "'num_attention_heads' must be >= 1, got 0"),
    ("num_hidden_layers", -1, "'num_hidden_layers' must be >= 1, got -1"),
    ("head_dim", 0, "'head_dim' must be >= 1, got 0"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be >= 1, got 0"),
    ("num_key_value_heads", 3, "must be a multiple of 'num_key_value_heads' (3)"),
    ("hidden_size", None, "'hidden_size' must be an integer, got None"),
    ("intermediate_size", -5, "'intermediate_size' must be >= 1"),
    ("rope_theta", float("nan"), "'rope_theta' must be a finite number > 0, got nan"),
    ("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a finite number > 0"),
    ("max_position_embeddings", 16, "'data.seq_len' (32) exceeds the model's max_position_embeddings (16)"),
])
def test_7_nonsense_config_json_is_refused(tmp_path, capsys, reference, key, value, fragment):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")

    def edit(config):
        config[key] = value
        if key == "rope_theta":
            config.pop("rope_parameters", None)

    edit_config(folder, edit)
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), fragment)
    assert not out.exists()


def test_7_header_dtype_must_be_a_float_for_weights(tmp_path, capsys, reference):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I32"  # same 4 bytes per element, other meaning
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    (folder / "model.safetensors").write_bytes(raw[:8] + new + raw[8 + n:])
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), "model.norm.weight", "int32", "floating-point")
    assert not out.exists()


def test_7_pickle_only_folder_is_refused_with_how_to_convert(tmp_path, capsys, reference):
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf", skip_suffix=".safetensors")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    out = tmp_path / "run"
    refused(*train(capsys, folder, data, out), "pytorch_model.bin", "safetensors", "save_pretrained")
    assert not out.exists()


# 8. Optimizer values are not validated --------------------------------------------------------


@pytest.mark.parametrize("key, value, fragment", [
    ("training.lr", "nan", "'training.lr' must be a finite number, got nan"),
    ("training.beta1", 1.5, "'training.beta1' must be in [0, 1), got 1.5"),
    ("training.beta2", -0.1, "'training.beta2' must be in [0, 1)"),
    ("training.weight_decay", "nan", "'training.weight_decay' must be a finite number"),
    ("training.eps", -1e-8, "'training.eps' must be > 0"),
    ("training.warmup_steps", 9, "'training.warmup_steps' (9) must be at most training.steps (4)"),
    ("training.max_grad_norm", "inf", "'training.max_grad_norm' must be a finite number"),
])
def test_8_optimizer_values_are_validated(tmp_path, capsys, reference, key, value, fragment):
    hf, data, _ = reference
    out = tmp_path / "run"
    refused(*train(capsys, hf, data, out, **{key: value}), fragment)
    assert not out.exists()


def test_8_nan_rope_theta_is_blamed_on_config_json(tmp_path, capsys, reference):
    """Before: exit 3 blaming the learning rate, after work was done."""
    hf, data, _ = reference
    folder = copy_of(hf, tmp_path / "hf")
    edit_config(folder, lambda config: config["rope_parameters"].update(rope_theta=float("nan")))
    refused(*train(capsys, folder, data, tmp_path / "run"), "config.json", "rope_parameters.rope_theta")


# 9. File-system faults end in tracebacks -----------------------------------------------------


def test_9_output_dir_that_is_a_file(tmp_path, capsys, reference):
    hf, data, _ = reference
    out = tmp_path / "run"
    out.write_text("a file")
    refused(*train(capsys, hf, data, out), "job.output_dir", "is not a folder")
    assert out.read_text() == "a file"


def test_9_read_only_output_dir(tmp_path, capsys, reference):
    hf, data, _ = reference
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    if not mounted and os.geteuid() != 0:
        ro.chmod(0o555)  # an unprivileged user cannot write there
    elif not mounted:
        # root, but no permission to mount: any read-only file system already mounted will do
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if "ro" in line.split()[3].split(",")]
        found = [Path(m) for m in mounts if Path(m).is_dir() and not (Path(m) / "run").exists()]
        assert found, "no way to get a read-only folder here: not mountable, running as root, none mounted"
        ro = found[0]
    try:
        refused(*train(capsys, hf, data, ro / "run"), "job.output_dir", str(ro))
        assert not (ro / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


def test_9_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, capsys, reference, monkeypatch):
    from tests.faults.inject import disk_full_after

    hf, data, want = reference
    out = tmp_path / "run"
    with disk_full_after(monkeypatch, out / "checkpoints", saves_allowed=1):
        code, err = train(capsys, hf, data, out)
    refused(code, err, "no space left on the device", "step-4", "step-2")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]  # no .tmp left
    assert training_state.verify(out / "checkpoints" / "step-2") == []
    assert train(capsys, hf, data, out)[0] == 0
    assert losses(out) == want


# 10. Silent wrong inputs ----------------------------------------------------------------------


def test_10_fifo_as_data_path_is_refused_not_read(tmp_path, capsys, reference):
    hf, _, _ = reference
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    signal.alarm(60)  # reading the FIFO would block forever
    try:
        refused(*train(capsys, hf, fifo, out), "data.path", "is a FIFO")
    finally:
        signal.alarm(0)
    assert not out.exists()


def test_storage_errors_name_the_cause():
    from titanite.files import storage_error

    e = storage_error(OSError(errno.ENOSPC, "No space left on device", "/x/y"), "saving step-4")
    assert str(e) == "no space left on the device (/x/y) while saving step-4"
