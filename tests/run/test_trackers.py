"""Experiment trackers (titanite/run/trackers.py), each read back through its own API or files.

For each tracker a tiny run of 3 steps, then a rerun to 5 steps that resumes from the step-3
checkpoint: the tracker's run holds metrics.jsonl's numbers under the same names at the same
steps, all five of them, in one tracker run (the same id, kept in trackers.json). A missing
package stops the run before any work (exit 2, naming it); a tracker that raises mid-run is
dropped with one warning, and the run and its metrics.jsonl go on as without it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics, tiny_train_args
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

# What the environment may say to the trackers (cleared here), and what titanite sets for them.
TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID",
               "TRACKIO_SERVER_URL", "WANDB_ERROR_REPORTING", "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_ALLOW_FILE_STORE")


@pytest.fixture(autouse=True)
def clean_tracker_env(monkeypatch):
    absent = [k for k in TRACKER_ENV if k not in os.environ]
    for k in TRACKER_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in absent:  # what titanite set during the test goes; monkeypatch restores the rest
        os.environ.pop(k, None)


def train(hf: Path, data: Path, out: Path, steps: int, trackers: str = "", **extra) -> None:
    opts = {"metrics.trackers": f"[{trackers}]", "checkpoint.export_hf": False, **extra}
    Trainer(load_config(None, tiny_train_args(hf, data, out, steps=steps, **opts))).train()


def jsonl_series(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {name: {step: value}}: every number but the step itself."""
    series: dict[str, dict[int, float]] = {}
    for row in read_metrics(out):
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, {})[row["step"]] = v
    return series


def assert_same_series(got: dict[str, dict[int, float]], out: Path, rel: float = 0.0, steps: int = 5) -> None:
    want = jsonl_series(out)
    assert sorted(got) == sorted(want)
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    assert set(want["loss"]) == set(range(1, steps + 1))
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=rel), k


def state(out: Path) -> dict:
    return json.loads((out / "trackers.json").read_text())


# -- TensorBoard -------------------------------------------------------------------------------


def test_tensorboard_alias_and_resume(tmp_path, tiny_hf, tiny_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(tiny_hf, tiny_data, out, 3, **{"metrics.tensorboard": True})  # the older spelling
    train(tiny_hf, tiny_data, out, 5, "tensorboard")
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    got = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert_same_series(got, out, rel=1e-6)  # TensorBoard keeps float32
    (config,) = events.Tensors("config/text_summary")  # the parameters, once, as text
    assert json.loads(config.tensor_proto.string_val[0].decode().strip("`\n"))["training"]["steps"] == 3
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 2  # one per attempt, one log dir


# -- MLflow ------------------------------------------------------------------------------------


def mlflow_runs(out: Path) -> tuple:
    """MLflow's client on the run's file store, and the runs of its 'titanite' experiment."""
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the reader's opt-in to a file store (cleared after)
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("titanite")
    return client, client.search_runs([experiment.experiment_id])


def test_mlflow_file_store_and_resume(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    train(tiny_hf, tiny_data, out, 3, "mlflow")
    first = state(out)["mlflow"]["run_id"]
    train(tiny_hf, tiny_data, out, 5, "mlflow")  # training.steps changes: MLflow would refuse it as a parameter
    client, runs = mlflow_runs(out)
    assert [r.info.run_id for r in runs] == [first] == [state(out)["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["training.steps"] == "3" and run.data.params["job.output_dir"] == str(out)
    got = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}
    assert_same_series(got, out)


def test_two_ranks_track_one_run_from_rank_zero(tmp_path, tiny_hf, tiny_data):
    """Under torchrun only rank 0 opens the tracker: one MLflow run, holding metrics.jsonl's rows."""
    from tests.parallel.test_distributed import torchrun

    out = tmp_path / "run"
    torchrun(2, tiny_train_args(tiny_hf, tiny_data, out, steps=3, **{
        "metrics.trackers": '["mlflow"]', "checkpoint.interval": 0, "training.batch_size": 2}))
    client, runs = mlflow_runs(out)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    got = {k: {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, k)} for k in runs[0].data.metrics}
    assert_same_series(got, out, steps=3)


# -- W&B ---------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of a .wandb file: W&B's transaction log (a LevelDB-style log of 32 KiB blocks,
    each record a chunk header <crc32 u32, length u16, type u8> then its bytes; types 1 = full,
    2/3/4 = first/middle/last), each record W&B's own protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def child_processes() -> list[str]:
    """Names of this process's live children (wandb's service process would be one)."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if int(fields[1].split()[1]) == os.getpid() and fields[1].split()[0] not in "ZX":
            names.append(fields[0].split("(", 1)[1])
    return names


def test_wandb_offline_run_and_resume(tmp_path, tiny_hf, tiny_data):
    out = tmp_path / "run"
    train(tiny_hf, tiny_data, out, 3, "wandb")
    run_id = state(out)["wandb"]["id"]
    train(tiny_hf, tiny_data, out, 5, "wandb")
    assert state(out)["wandb"]["id"] == run_id
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # two attempts, one run
    got: dict[str, dict[int, float]] = {}
    for f in files:
        for record in wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "titanite"
                assert record.run.display_name == "run"
                config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
                assert config["training"]["lr"] == pytest.approx(1e-3)
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                        got.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    assert_same_series(got, out)
    assert "wandb-core" not in child_processes()  # its service ended with the run


# -- trackio -----------------------------------------------------------------------------------

# trackio reads its store's folder once per process, when first imported, so its runs get a
# process of their own: both attempts, then the read-back through trackio's API.
TRACKIO_RUNS = """
import json, sys
from titanite.core.config import load_config
from titanite.run.trainer import Trainer
for args in json.loads(sys.argv[1]):
    Trainer(load_config(None, args)).train()
import trackio
from trackio.sqlite_storage import SQLiteStorage
runs = [(r.name, r.id, r.config) for r in trackio.Api().runs("titanite")]
logs = SQLiteStorage.get_logs("titanite", runs[0][0], run_id=runs[0][1])
print(json.dumps({"store": str(trackio.utils.TRACKIO_DIR), "runs": runs, "logs": logs}, default=str))
"""


def test_trackio_local_store_and_resume(tmp_path, tiny_hf, tiny_data):
    out, home = tmp_path / "run", tmp_path / "hf-home"
    attempts = [tiny_train_args(tiny_hf, tiny_data, out, steps=steps, **{
        "metrics.trackers": "[trackio]", "checkpoint.export_hf": False}) for steps in (3, 5)]
    env = {**os.environ, "HF_HOME": str(home), "OMP_NUM_THREADS": "2"}  # trackio's own default is under HF_HOME
    proc = subprocess.run([sys.executable, "-c", TRACKIO_RUNS, json.dumps(attempts)], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    read = json.loads(proc.stdout.strip().splitlines()[-1])
    assert read["store"] == str(out / "trackio") and not (home / "trackio").exists()
    assert [(name, run_id) for name, run_id, _ in read["runs"]] == [("run", state(out)["trackio"]["id"])]
    assert read["runs"][0][2]["training"]["lr"] == pytest.approx(1e-3)
    got: dict[str, dict[int, float]] = {}
    for entry in read["logs"]:
        for k, v in entry.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                got.setdefault(k, {})[entry["step"]] = v
    assert_same_series(got, out)


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key, tracker, module", [("metrics.trackers", "wandb", "wandb"),
                                                  ("metrics.trackers", "mlflow", "mlflow"),
                                                  ("metrics.trackers", "trackio", "trackio"),
                                                  ("metrics.trackers", "tensorboard", "tensorboard"),
                                                  ("metrics.tensorboard", "tensorboard", "tensorboard")])
def test_missing_package_is_a_preflight_error(tmp_path, tiny_hf, tiny_data, monkeypatch, capsys, key, tracker,
                                              module):
    from titanite.cli import main

    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` now fails, as when it is not installed
    value = "true" if key == "metrics.tensorboard" else f"[{tracker}]"
    out = tmp_path / "run"
    assert main(["train", *tiny_train_args(tiny_hf, tiny_data, out, **{key: value})]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and f"the {module} package is not installed" in err and f"titanite[{tracker}]" in err
    assert not out.exists() or not any(out.iterdir())  # stopped before any work


def test_failing_tracker_is_dropped_and_training_goes_on(tmp_path, tiny_hf, tiny_data, monkeypatch, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titanite.run import trackers

    train(tiny_hf, tiny_data, tmp_path / "plain", 5)
    real_log, calls = trackers._MLflow.log, []

    def full_disk(self, values, step):
        calls.append(step)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real_log(self, values, step)

    monkeypatch.setattr(trackers._MLflow, "log", full_disk)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="titanite"):
        train(tiny_hf, tiny_data, out, 5, "tensorboard,mlflow")
    warnings = [r.getMessage() for r in caplog.records if "mlflow" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "dropped" in warnings[0]
    assert calls == [1, 2]  # never called again once dropped
    rows, plain = read_metrics(out), read_metrics(tmp_path / "plain")
    assert [sorted(r) for r in rows] == [sorted(r) for r in plain]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_seen"):
        assert [r[key] for r in rows] == [r[key] for r in plain], key
    events = EventAccumulator(str(out / "tb"))  # the other tracker kept every row
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    client, runs = mlflow_runs(out)
    assert runs[0].info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [1]


def test_a_run_that_fails_still_finishes_its_tracker_runs(tmp_path, tiny_hf, tiny_data, monkeypatch):
    out, steps = tmp_path / "run", []
    real_step = Trainer.train_step

    def failing_step(self):
        steps.append(self.step)
        if len(steps) == 3:
            raise RuntimeError("a bug in step 3")
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="a bug in step 3"):
        train(tiny_hf, tiny_data, out, 5, "wandb,mlflow")
    (wandb_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]
    assert "wandb-core" not in child_processes()
    _, runs = mlflow_runs(out)
    assert runs[0].info.status == "FAILED"


def test_an_unknown_tracker_names_the_key():
    from titanite.core.errors import UserError

    with pytest.raises(UserError, match=r"'metrics.trackers\[1\]': 'wandbb' .* \(did you mean 'wandb'\?\)"):
        load_config(None, ["--metrics.trackers=[mlflow,wandbb]"])
