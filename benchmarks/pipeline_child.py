"""What benchmarks/pipeline.py runs in each rank (not a script of its own).

`--rank ARGV...`: one rank of titanite.train's main, with

- the rank's VmHWM (/proc/self/status, the kernel's high-water mark of the resident set) when
  the end-of-run save begins (so through the training steps) and at exit;
- under pipeline parallelism, the time of every pipeline pass (`Pipeline.step`: the schedule's
  forwards and backwards of the pass's micro-batches, p2p transfers included) and, inside it,
  of the stage's compute actions: torch.distributed.pipelining's `forward_one_chunk`,
  `backward_one_chunk` and `backward_weight_one_chunk` (the only calls that run the stage's
  module or its autograd graph; the schedule waits for the neighbours' activations or
  gradients before calling them, so a wait is never inside one). Wall time (perf_counter) and
  the main thread's CPU time (thread_time, with one intra-op thread the compute's) of each;
- every training step's wall time and the process's CPU time (process_time: every thread's,
  the communication library's included);
- the layout the trainer resolved: `PipelineLayout.describe()`, `.bubble()` (the planner's
  theoretical idle share), its micro-batches per pass and the stages this rank runs.

One JSON file per rank in $TITANITE_PP_RECORD. `--baseline`: a process that only imports
titanite.run.trainer (the floor under every rank).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from common import train_and_record, write_baseline

RECORD_ENV = "TITANITE_PP_RECORD"


def rank(argv: list[str]) -> None:
    if write_baseline(argv, RECORD_ENV):
        return
    record = Path(os.environ[RECORD_ENV])
    me = int(os.environ.get("RANK", "0"))
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import titanite.run.trainer
    from titanite.parallel import pipeline_runner as pipeline_module

    marks: dict = {"passes": [], "steps": [], "layout": None}
    current: dict = {"step": 0, "pass": None}

    # -- the steps: which step a pass belongs to -------------------------------------------
    train_step = titanite.run.trainer.Trainer.train_step

    def marked_step(self, *a, **kw):
        current["step"] = self.step + 1
        w, c = time.perf_counter(), time.process_time()
        try:
            return train_step(self, *a, **kw)  # on a CPU every op has run when it returns
        finally:
            marks["steps"].append({"step": current["step"], "wall_s": time.perf_counter() - w,
                                   "cpu_s": time.process_time() - c})

    titanite.run.trainer.Trainer.train_step = marked_step

    # -- the layout the trainer resolved -------------------------------------------------------
    init = pipeline_module.Pipeline.__init__

    def marked_init(self, handle, world, layout, *a, **kw):
        init(self, handle, world, layout, *a, **kw)
        marks["layout"] = {"describe": layout.describe(), "bubble": layout.bubble(), "pp": layout.pp,
                           "schedule": layout.schedule.name, "microbatches": layout.microbatches,
                           "sizes": list(layout.sizes), "pp_rank": world.pp_rank,
                           "stages": layout.stages_of(world.pp_rank)}

    pipeline_module.Pipeline.__init__ = marked_init

    # -- a pass, and the compute actions inside it ---------------------------------------------
    step = pipeline_module.Pipeline.step

    def timed_pass(self, *a, **kw):
        p = {"step": current["step"], "compute_s": 0.0, "compute_cpu_s": 0.0, "actions": 0,
             "fwd_s": 0.0, "bwd_s": 0.0, "bwd_w_s": 0.0}
        current["pass"] = p
        w, c = time.perf_counter(), time.thread_time()
        try:
            return step(self, *a, **kw)
        finally:
            p["wall_s"], p["cpu_s"] = time.perf_counter() - w, time.thread_time() - c
            current["pass"] = None
            marks["passes"].append(p)

    pipeline_module.Pipeline.step = timed_pass

    def timed(name: str, fn):
        def wrapped(*a, **kw):
            p = current["pass"]
            if p is None:  # a forward-only or evaluation pass: not timed
                return fn(*a, **kw)
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                dw = time.perf_counter() - w
                p[name] += dw
                p["compute_s"] += dw
                p["compute_cpu_s"] += time.thread_time() - c
                p["actions"] += 1
        return wrapped

    _PipelineStageBase.forward_one_chunk = timed("fwd_s", _PipelineStageBase.forward_one_chunk)
    _PipelineStageBase.backward_one_chunk = timed("bwd_s", _PipelineStageBase.backward_one_chunk)
    _PipelineStageBase.backward_weight_one_chunk = timed("bwd_w_s", _PipelineStageBase.backward_weight_one_chunk)

    train_and_record(argv, marks, record, me)  # with the peak memory through the steps


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "--rank":
        rank(sys.argv[2:])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
