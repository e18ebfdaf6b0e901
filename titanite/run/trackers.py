"""Experiment trackers: every row of metrics.jsonl also goes to TensorBoard, W&B, MLflow or trackio.

MetricsLogger starts them on rank 0 only. Each row goes to each tracker under its metrics.jsonl
names, at its step; the resolved config is the tracker run's parameters. Everything stays local
unless the user's environment names a server:

- tensorboard: event files in <output_dir>/tb.
- wandb: offline mode under <output_dir>/wandb, unless WANDB_MODE / WANDB_DIR say otherwise.
- mlflow: a file store in <output_dir>/mlruns, unless MLFLOW_TRACKING_URI is set.
- trackio: its SQLite store in <output_dir>/trackio, unless TRACKIO_DIR is set.

The tracker runs' ids are kept in <output_dir>/trackers.json, so a run that resumes from a
checkpoint continues the same tracker runs; a run that starts at step 0 starts new ones. A tracker
whose package is missing is a preflight error (`check_installed`); one that raises while the run
goes on is reported once and dropped, because tracking must never stop training.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanite.core.config import TRACKERS, Config, MetricsConfig, to_dict
from titanite.core.errors import UserError

log = logging.getLogger("titanite")

# tracker -> (the module it imports, the package pip installs); the extra is titanite[<tracker>].
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny"), "trackio": ("trackio", "trackio")}
STATE_FILE = "trackers.json"


def enabled(cfg: MetricsConfig) -> list[str]:
    """The trackers a run uses: metrics.trackers, plus 'tensorboard' when metrics.tensorboard
    (the older spelling) is on."""
    wanted = set(cfg.trackers) | ({"tensorboard"} if cfg.tensorboard else set())
    return [name for name in TRACKERS if name in wanted]


def check_installed(cfg: MetricsConfig) -> None:
    """A UserError naming the package and its extra for the first tracker that cannot be imported."""
    for name in enabled(cfg):
        module, package = PACKAGES[name]
        if not _importable(module):
            key = "metrics.trackers" if name in cfg.trackers else "metrics.tensorboard"
            raise UserError(f"config key '{key}' asks for {name}, but the {module} package is not installed: "
                            f"pip install 'titanite[{name}]' (or pip install {package})")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module without a spec, or one that fails to import
        return False


@dataclass
class RunInfo:
    """What every tracker is started with."""

    out: Path
    project: str
    name: str
    params: dict[str, dict[str, Any]]  # the resolved config, as config.toml's tables
    resume_step: int  # the checkpoint's step; 0 = a new run


class Trackers:
    """The run's live trackers. `log` and `close` never raise: a tracker that fails is dropped
    with one warning."""

    def __init__(self, out: Path, cfg: Config, resume_step: int) -> None:
        m = cfg.metrics
        run = RunInfo(out, m.project, m.run_name or out.resolve().name, to_dict(cfg), resume_step)
        path = out / STATE_FILE
        saved = json.loads(path.read_text()) if resume_step and path.is_file() else {}
        self.live: dict[str, Any] = {}
        for name in enabled(m):
            previous = saved.get(name)
            if previous is not None and previous.get("project") != run.project:
                previous = None  # a new project is a new tracker run
            try:
                self.live[name] = _START[name](run, previous)
            except Exception as e:  # noqa: BLE001 - a tracker that cannot start must not stop training
                log.warning("metrics: %s could not start (%s: %s); the run goes on without it",
                            name, type(e).__name__, e)
        if self.live:
            saved.update({name: {"project": run.project, **t.state} for name, t in self.live.items()})
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(saved, indent=1) + "\n")
            tmp.replace(path)

    def log(self, row: dict[str, Any]) -> None:
        """Send a metrics.jsonl row: every number but `step`, at `step` (nulls are left out)."""
        values = {k: v for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name in list(self.live):
            try:
                self.live[name].log(values, row["step"])
            except Exception as e:  # noqa: BLE001 - dropped, reported once, training goes on
                tracker = self.live.pop(name)
                log.warning("metrics: %s failed (%s: %s); it is dropped for the rest of the run, training "
                            "goes on", name, type(e).__name__, e)
                try:
                    tracker.close(failed=True)
                except Exception as close_error:  # noqa: BLE001 - already reported above
                    log.debug("metrics: %s failed to close too: %s", name, close_error)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker run (and end what it runs in the background)."""
        while self.live:
            name, tracker = self.live.popitem()
            try:
                tracker.close(failed=failed)
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more
                log.warning("metrics: %s could not finish its run (%s: %s)", name, type(e).__name__, e)


class _TensorBoard:
    def __init__(self, run: RunInfo, previous: dict | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run.out / "tb"
        # On resume, TensorBoard hides what an interrupted attempt logged after the checkpoint.
        self.writer = SummaryWriter(str(log_dir), purge_step=run.resume_step + 1 if run.resume_step else None)
        if not run.resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(run.params, indent=1) + "\n```")
        self.state = {"dir": str(log_dir)}

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run: RunInfo, previous: dict | None) -> None:
        # wandb-core sends its own error reports to W&B's servers unless told not to.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        self.wandb = wandb
        where: dict[str, Any] = {}
        if "WANDB_MODE" not in os.environ:
            where["mode"] = "offline"  # `wandb sync <output_dir>/wandb/offline-run-*` uploads it later
        if "WANDB_DIR" not in os.environ:
            where["dir"] = str(run.out)
        if previous is not None:
            where.update(id=previous["id"], resume="allow")
        self.run = wandb.init(project=run.project, name=run.name, config=run.params, reinit="create_new", **where)
        self.state = {"id": self.run.id}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        if self.wandb.run is None:  # no other run of this process needs wandb's service process
            self.wandb.teardown()


# MLflow's names: alphanumerics, _ - . / space and colon; anything else becomes "_".
_MLFLOW_NAME = re.compile(r"[^\w./\- :]")
_MLFLOW_PARAM_CHARS = 6000  # the longest parameter value MLflow stores


class _MLflow:
    def __init__(self, run: RunInfo, previous: dict | None) -> None:
        # `import mlflow` starts reporting usage to mlflow.org unless this is set.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run.out / "mlruns").resolve().as_uri()
            # MLflow 3.17 refuses a file store unless asked; this one is titanite's own default.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.client, self.metric = MlflowClient(tracking_uri=uri), Metric
        if previous is not None and previous.get("tracking_uri") == uri:
            self.run_id = previous["run_id"]
            # No parameters again: MLflow refuses a parameter whose value changed within a run.
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(run.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(run.project))
            self.run_id = self.client.create_run(experiment_id, run_name=run.name,
                                                 tags={"titanite.output_dir": str(run.out.resolve())}).info.run_id
            params = [Param(_MLFLOW_NAME.sub("_", k), v[:_MLFLOW_PARAM_CHARS]) for k, v in _flat(run.params)]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.state = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(_MLFLOW_NAME.sub("_", k), float(v), now, step)
                                                    for k, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _flat(params: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """("section.key", value as text) for every config value; lists and tables as JSON."""
    for section, table in params.items():
        for key, value in table.items():
            yield f"{section}.{key}", value if isinstance(value, str) else json.dumps(value)


class _Trackio:
    def __init__(self, run: RunInfo, previous: dict | None) -> None:
        wanted = Path(os.environ.get("TRACKIO_DIR") or run.out / "trackio")
        with _environ(TRACKIO_DIR=str(wanted)):  # trackio reads it once, when first imported
            import trackio
            import trackio.utils
        store = Path(trackio.utils.TRACKIO_DIR)
        if store.resolve() != wanted.resolve():
            log.warning("metrics: trackio was imported before this run pointed it at %s; it logs to %s",
                        wanted, store)
        printed = io.StringIO()  # its console hints omit the store's folder; ours below names it
        with contextlib.redirect_stdout(printed):
            self.run = trackio.init(project=run.project, name=previous["name"] if previous else run.name,
                                    config=run.params, resume="allow" if previous else "never", embed=False)
        log.debug("trackio: %s", printed.getvalue().strip())
        if previous is not None and self.run.id != previous["id"]:
            log.warning("metrics: trackio run %s (id %s) is not in %s; logging to a new run", previous["name"],
                        previous["id"], store)
        log.info("metrics: trackio run %s of project %s in %s (TRACKIO_DIR=%s trackio show)",
                 self.run.name, run.project, store, store)
        self.state = {"name": self.run.name, "id": self.run.id, "dir": str(store)}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        from trackio import context_vars

        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
        if context_vars.current_run.get() is self.run:  # else trackio's exit hook finishes it again
            context_vars.current_run.set(None)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables the user has not set, for the duration of the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


_START = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}
