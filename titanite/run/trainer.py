"""The training loop: build -> (resume) -> step -> log -> checkpoint -> export.

Backend-specific work goes through the model handle (titanite/models/handle.py); this file never
asks which backend it runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from titanite.checkpoint import training_state
from titanite.checkpoint.finite import FiniteWatch, all_finite, first_nonfinite, optimizer_tensors
from titanite.checkpoint.saving import Saver
from titanite.core.config import Config, to_toml
from titanite.core.errors import TrainingDiverged
from titanite.data.loader import make_loader
from titanite.data.prefetch import Prefetcher
from titanite.device.choice import is_host, synchronize
from titanite.device.memory import has_pinned_memory, memory_stats, reset_peak_memory, set_host_memory_policy
from titanite.device.peak import peak_flops, warn_if_slow_bf16
from titanite.evaluation.heldout import Evaluator, eval_due
from titanite.models import lora
from titanite.models.lora import adapter as lora_adapter
from titanite.parallel import distributed
from titanite.parallel.context import ContextParallel
from titanite.parallel.grad_norm import clip_grad_norm_
from titanite.parallel.pipeline_runner import Pipeline
from titanite.parallel.plans import parallelize
from titanite.run import exports, lm_step, lm_step_pipelined
from titanite.run.metrics import MetricsLogger, Mfu, StepResult
from titanite.run.optim import build_optimizer, lr_at, set_lr
from titanite.run.preference.objective import build_objective
from titanite.run.preflight import Prepared, preflight
from titanite.run.runlock import RunLock
from titanite.run.step_context import StepContext

log = logging.getLogger("titanite")
_NEVER = 2**62  # "no step" in min-over-ranks reductions of a first bad step


class Trainer:
    """Preflight (every check, nothing written), then the run: lock the output folder, start
    the process group, build the data, materialise, resume or load, and train."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.out = Path(cfg.job.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        ready = preflight(cfg)  # a UserError here leaves the output folder as it was
        self.rank = int(os.environ.get("RANK", "0"))
        self.lock = RunLock(self.out).acquire() if self.rank == 0 else None
        try:
            self._start(ready)
        except BaseException:
            self.close(remove_empty_output=True)
            raise

    def _start(self, ready: Prepared) -> None:
        cfg = self.cfg
        self.device, self.handle, self.model = ready.device, ready.handle, ready.handle.module
        if is_host(self.device):  # before the step's allocations; see docs/performance.md
            set_host_memory_policy(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.tokenizer, self.accum = ready.tokenizer, ready.grad_accum
        self.world = distributed.init(self.device, cfg.parallelism)
        self.cp = ContextParallel(self.world.meshes["cp"], cfg.data.seq_len) if self.world.cp > 1 else None
        self.saver = Saver(cfg.checkpoint.async_mode, self.device, cfg.parallelism.collective_timeout_s)
        self.config_toml = to_toml(cfg)
        self.loader = base_loader = make_loader(cfg.data, self.tokenizer, cfg.training.batch_size, cfg.job.seed,
                                                rank=self.world.dp_rank, world_size=self.world.dp_size)
        if self.cp is not None:  # this rank's chunks of every sequence
            self.loader = self.cp.loader(self.loader)
        if cfg.data.prefetch:
            pin = has_pinned_memory(self.device.type)
            self.loader = Prefetcher(self.loader, cfg.data.prefetch, pin=pin)
            log.info("data: prefetching %d batches ahead, in %s host memory", cfg.data.prefetch,
                     "pinned" if pin else "pageable")
        self.evaluator = (Evaluator(cfg, self.tokenizer, self.world.dp_rank, self.world.dp_size)
                          if cfg.eval.path else None)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if cfg.training.mixed_precision == "bf16" else contextlib.nullcontext())
        self.ctx = StepContext(cfg, self.handle, self.world, self.device, self.accum, self.autocast, self.cp)
        self.benchmarks = exports.loop_benchmarks(self.ctx, self.tokenizer) if cfg.eval.tasks else None
        self.step = 0
        training_state.remove_stale_temporaries(self.ckpt_root)
        resuming = cfg.checkpoint.resume and bool(training_state.list_checkpoints(self.ckpt_root))
        self.pipeline = None
        if ready.pipeline is not None:
            self.pipeline = Pipeline(self.handle, self.world, ready.pipeline, lm_step_pipelined.stage_hook(self.ctx),
                                     lm_step_pipelined.around_stage(self.ctx))
            self.ctx.pipeline = self.pipeline
            log.info("pipeline: %s; this rank runs stages %s; bubble %.1f%% in theory", ready.pipeline.describe(),
                     ready.pipeline.stages_of(self.world.pp_rank), 100 * ready.pipeline.bubble())
        parallelize(self.handle, self.world, cfg,  # on the meta device: nothing is allocated yet
                    self.pipeline.parts if self.pipeline is not None else None)
        self._materialize(ready.weights, resuming)
        self.optimizer = build_optimizer(self.model, cfg.training)
        adapters = self.handle.lora
        self.lora_record = (lora_adapter.run_record(adapters.cfg, adapters.all_targets, cfg.model.hf_path)
                            if adapters else None)
        if resuming:
            path, state = training_state.resume(self.ckpt_root, self.model, self.optimizer)
            if self.lora_record is not None:
                lora_adapter.check_run_record(path, state, self.lora_record, cfg.model.hf_path)
            self.step = state["step"]
            self.loader.load_state_dict(state["data"])
            log.info("resumed from %s at step %d", path, self.step)
        self.finite = FiniteWatch(self.device)
        self.compute_dtype = ready.compute_dtype
        self.flops_per_token = self.handle.flops_per_token(cfg.data.seq_len)
        self.preference = (build_objective(self.ctx, ready, base_loader, self.evaluator)
                           if cfg.training.objective == "dpo" else None)
        if self.preference is not None:  # MFU counts the reference's forward too
            self.flops_per_token += self.preference.reference_flops_per_token(cfg.data.seq_len)
        self.mfu = Mfu(peak_flops(self.device, ready.compute_dtype, cfg.metrics.peak_tflops),
                       self.flops_per_token, self.world.size, self.device, ready.compute_dtype)
        if ready.compute_dtype == torch.bfloat16:
            warn_if_slow_bf16(self.device)
        if self.rank == 0:  # the first file a run writes, once everything it needs has loaded
            (self.out / "config.toml").write_text(self.config_toml)
        self.metrics = MetricsLogger(self.out, cfg.metrics, cfg.training.steps, self.rank)
        self.metrics.truncate_after(self.step)
        self.metrics.start_trackers(cfg, self.step)
        self.stop_signal: int | None = None
        n = self.handle.num_params()
        log.info("model %s: %.2fM parameters (%d stored on this rank), %s, %d-step grad accumulation, "
                 "device %s, peak %s", cfg.model.spec, n / 1e6, distributed.local_numel(self.model),
                 cfg.training.mixed_precision, self.accum, self.device, self.mfu.peak.describe())

    def close(self, remove_empty_output: bool = False) -> None:
        """Release the output folder's lock (train() does this itself; call it after driving
        train_step by hand). `remove_empty_output`: also remove a folder this run created and
        never wrote into."""
        if isinstance(getattr(self, "loader", None), Prefetcher):
            self.loader.close()
        if getattr(self, "saver", None) is not None:  # a background save ends with the run
            self.saver.close()
        if getattr(self, "metrics", None) is not None:  # trackers' runs and their service processes end here
            self.metrics.close()
        if self.lock is not None:
            self.lock.release(remove_folder_if_empty=remove_empty_output)
            self.lock = None

    def _materialize(self, weights: str | None, resuming: bool) -> None:
        """Allocate this rank's shards of the sharded meta model on the device, then load
        `weights` (an HF folder; each rank reads its own slices) or initialise (seeded, the same
        weights under every layout); a run that resumes leaves that to the checkpoint, except
        for a LoRA model's frozen base, which its checkpoints do not hold."""
        self.model.to_empty(device=self.device)
        self.handle.init_buffers()
        torch.manual_seed(self.cfg.job.seed)
        adapters = self.handle.lora
        if resuming and adapters is None:
            return
        if weights is not None:
            self.handle.load_hf(weights)
        else:
            self.handle.init_weights(self.cfg.model.init_std, self.cfg.job.seed)
        if adapters is not None:
            lora.init_adapters(self.model, adapters.targets, adapters.cfg, self.cfg.job.seed)
            if adapters.cfg.adapter_path and not resuming:
                lora_adapter.load_adapter(Path(adapters.cfg.adapter_path), self.model, adapters.targets, adapters.cfg,
                                          self.cfg.model.hf_path, adapters.all_targets)
                log.info("adapters start from %s", adapters.cfg.adapter_path)
        self.handle.init_buffers()

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> None:
        cfg = self.cfg
        try:
            if self.step >= cfg.training.steps:
                log.info("checkpoint is already at step %d of %d; nothing to train", self.step, cfg.training.steps)
                self._finish(save=False)
                return
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                self._loop()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        finally:
            self.saver.close()  # before the process group goes: a background save uses it
            self.metrics.close(failed=sys.exc_info()[0] is not None)
            self.world.close(in_step=sys.exc_info()[0] is None)
            self.close()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.stop_signal = signum
        log.warning("%s received: finishing step %d, saving a checkpoint, then exiting",
                    signal.Signals(signum).name, self.step + 1)

    def _loop(self) -> None:
        cfg = self.cfg
        tokens_per_step = ((2 if self.preference else 1) * cfg.training.batch_size * cfg.data.seq_len  # a pair: 2 rows
                           * self.accum * self.world.dp_size)
        window_start, window_steps = time.perf_counter(), 0
        reset_peak_memory(self.device)
        while self.step < cfg.training.steps:
            result = self.train_step()
            self.step += 1
            window_steps += 1
            eval_row: dict[str, float] = {}
            if ((self.evaluator is not None or self.benchmarks is not None)
                    and eval_due(self.step, cfg.eval.interval, cfg.training.steps)):
                eval_start = time.perf_counter()
                eval_row = self.evaluate()
                window_start += time.perf_counter() - eval_start  # not training throughput
            if self.metrics.should_log(self.step) or eval_row:
                # The only host reads of a step, and only on logging steps: the non-finite
                # watch, then every logged number in one transfer.
                self._stop_if_nonfinite(before_save=False)
                values = result.read()
                synchronize(self.device)
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed
                mem = memory_stats(self.device)
                self.metrics.log({
                    "step": self.step, "lr": lr_at(cfg.training, self.step - 1), **values,
                    "tokens_per_sec": tps, "mfu": self.mfu(tps),
                    "mem_gib": mem.get("device_peak_alloc_gib") or mem["host_peak_rss_gib"],
                    **mem, "tokens_seen": tokens_per_step * self.step,
                    **self.loader.data_metrics(), **eval_row,
                })
                window_start, window_steps = time.perf_counter(), 0
            interval = cfg.checkpoint.interval
            # Every rank must agree to stop, or the ones that did not see the signal would wait
            # in the next step's collectives while the others save.
            # A background save that failed stops every rank too: _save raises its error (exit 2).
            if self.world.any_rank(self.stop_signal is not None or self.saver.failed()):
                self.stop_signal = self.stop_signal or signal.SIGTERM
                self._save(final=True)
                log.warning("stopped by %s at step %d; rerun the same command to resume",
                            signal.Signals(self.stop_signal).name, self.step)
                return
            if interval and self.step % interval == 0 and self.step < cfg.training.steps:
                self._save()
        self._finish(save=True)

    def train_step(self) -> StepResult:
        """One optimizer step over `accum` micro-batches of the objective (titanite/run/lm_step.py,
        lm_step_pipelined.py or preference/objective.py, each given the step context). Nothing is
        read on the host (StepResult.read is the logging step's one transfer): a non-finite loss or
        gradient norm is recorded by the watch and its update skipped on the device (found_inf), so
        the weights stay finite until a log or save stops the run."""
        batches = [self.loader.next_batch() for _ in range(self.accum)]
        self.model.train()
        self.ctx.step = self.step
        if self.preference is not None:
            accumulate = self.preference.accumulate
        else:
            accumulate = lm_step_pipelined.accumulate if self.pipeline is not None else lm_step.accumulate
        total, aux_total, stats = accumulate(self.ctx, batches)
        stages = self.world.meshes["pp"].get_group() if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm or math.inf, stages)
        ok = torch.isfinite(total) & torch.isfinite(grad_norm)
        self.finite.note_update(self.step + 1, ok, total, grad_norm)
        set_lr(self.optimizer, lr_at(self.cfg.training, self.step))
        self.optimizer.found_inf = (~ok).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.finite.note_weights(self.step + 1, self.model.parameters())
        self.handle.after_optimizer_step(self.world.all_reduce_sum)
        return StepResult(total, grad_norm, aux_total, stats)

    def _stop_if_nonfinite(self, before_save: bool) -> None:
        """Exit 3 when the watch recorded a non-finite step, or, before a save, when any
        parameter or optimizer tensor is not finite: such state is never written."""
        first = self.finite.first()
        step = self.world.min_over_ranks(first[0] if first else _NEVER)
        ok = True
        if before_save:
            ok = bool(all_finite([*self.model.parameters(), *optimizer_tensors(self.optimizer)]))
        if step == _NEVER and not self.world.any_rank(not ok):
            return
        if first is not None and first[0] == step and first[1] == FiniteWatch.LOSS:
            what = f"loss is {first[2]} (grad norm {first[3]}) at step {step}; its update was skipped"
        elif step != _NEVER:
            what = f"the weights became non-finite after the update of step {step}, although its loss was finite"
        else:
            what = f"the state to save at step {self.step} is not finite"
        self._diverged(what)

    def _diverged(self, what: str) -> None:
        """Raise TrainingDiverged (exit 3) naming what went non-finite, where it first did, the
        first offending tensor, and the last good checkpoint, which stays untouched."""
        names = [n for n in distributed.gather_texts(first_nonfinite(self.model, self.optimizer) or "") if n]
        detail = f"; first non-finite tensor: {names[0]}" if names else ""
        self.saver.close()  # a save in flight was finite (checked before staging): let it land first
        latest = training_state.latest_checkpoint(self.ckpt_root)
        raise TrainingDiverged(
            f"{what}{detail}; stopped without saving. Last good checkpoint: {latest or 'none'}. Lower "
            "training.lr, raise training.warmup_steps or check the data; rerunning resumes from that "
            "checkpoint.")

    def evaluate(self) -> dict[str, float]:
        """Loss and perplexity on the held-out data (eval.path; titanite/evaluation/heldout.py) and the
        eval.tasks benchmark scores (titanite/evaluation/harness.py)."""
        def loss_sum(b: dict[str, torch.Tensor]) -> torch.Tensor:  # of whole sequences, on every cp rank
            objective = lm_step_pipelined if self.pipeline is not None else lm_step
            return objective.eval_loss(self.ctx, b)

        row: dict[str, float] = {}
        if self.evaluator is not None and self.preference is not None:
            row |= self.preference.evaluate(self.evaluator.batches())
        elif self.evaluator is not None:
            row |= self.evaluator.run(self.model, loss_sum, self.world.all_reduce_sum_dp, self.device)
        if self.benchmarks is not None:
            row |= self.benchmarks.run(self.model)
        return row

    # -- saving -----------------------------------------------------------------------------

    def _save(self, final: bool = False) -> None:
        """Checkpoint this step (checkpoint.async_mode: written now, or in the background once the
        state is staged, after the save in flight lands). `final`: the run ends after it, so the
        export and the exit wait for it."""
        self._stop_if_nonfinite(before_save=True)
        state: dict[str, Any] = {"data": self.loader.state_dict()}
        if self.lora_record is not None:  # the base the adapters belong to (re-read on resume)
            state.update(self.lora_record)
        self.saver.save(self.ckpt_root, self.step, self.model, self.optimizer, state, self.config_toml,
                        self.cfg.checkpoint.keep_latest)
        if final:
            self.saver.wait()

    def _finish(self, save: bool) -> None:
        if save:
            self._save(final=True)
        if not self.cfg.checkpoint.export_hf:
            return
        if self.handle.lora is None:
            self.export(self.out / "hf")
            return
        self.export_adapter(self.out / "adapter")
        if self.cfg.checkpoint.export_merged:
            self.export(self.out / "hf", merged=True)

    def export_adapter(self, out: Path) -> None:
        """The adapters in peft's format (titanite/models/lora/adapter.py); every rank takes part."""
        exports.adapter(self.handle, self.cfg, self.lora_record, out, self.rank, self.world)

    def export(self, out: Path, merged: bool = False) -> None:
        """The Hugging Face folder (with `merged`, a LoRA run's adapters folded in); every rank takes part."""
        exports.model(self.handle, self.cfg, self.tokenizer, out, self.rank, merged, self.world)
