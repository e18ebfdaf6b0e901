"""Pipeline parallelism's layout, as plain arithmetic: which schedules exist, how the layers are
split into stages, which stages each pipeline rank runs and what a schedule needs.

The trainer (titanite/parallel/pipeline_runner.py), the preflight checks and the planner
(titanite/plan/pipeline_costs.py) all read it from here, so they agree on every number.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanite.core.errors import UserError, did_you_mean
from titanite.models.flops import head_flops, layer_flops
from titanite.models.qwen3.args import Qwen3Args


@dataclass(frozen=True)
class Schedule:
    name: str  # torch.distributed.pipelining's schedule name
    stages_per_rank: int
    v_shape: bool = False  # rank r runs stages r and 2 pp - 1 - r (else r, r + pp, ...)
    split_backward: bool = False  # input and weight gradients run as separate actions (zero bubble)

    def bubble(self, pp: int, microbatches: int, stages_per_rank: int = 0) -> float:
        """The idle share of a step on each rank, in theory, with forward and backward costing
        1 and 2 units per stage and micro-batch: (pp - 1) stage-slots of warm-up and drain over
        v stages per rank. Zero-bubble schedules fill most of it with weight gradients (counted
        as a third of the drain)."""
        if pp == 1:
            return 0.0
        v = stages_per_rank or self.stages_per_rank
        idle = (pp - 1) / v
        if self.split_backward:
            idle /= 3
        return idle / (microbatches + idle)


SCHEDULES = {s.name: s for s in (
    Schedule("GPipe", 1),
    Schedule("1F1B", 1),
    Schedule("Interleaved1F1B", 2),
    Schedule("LoopedBFS", 2),
    Schedule("InterleavedZeroBubble", 2, split_backward=True),
    Schedule("ZBVZeroBubble", 2, v_shape=True, split_backward=True),
    Schedule("DualPipeV", 2, v_shape=True, split_backward=True),
)}


def schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise UserError(f"config key 'parallelism.pp_schedule': unknown schedule '{name}'{did_you_mean(name, SCHEDULES)}; "
                        f"schedules: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def stage_costs(a: Qwen3Args, seq_len: int) -> tuple[list[float], float, float]:
    """(FLOPs per token of each block, of what the first stage adds, of what the last adds):
    the embedding lookup costs no matmul FLOPs but its gradient is a scatter over the hidden
    size, counted as one hidden-size pass; the last stage adds the final norm and the head."""
    return ([layer_flops(a, i, seq_len) for i in range(a.num_layers)], 6.0 * a.hidden_size, head_flops(a))


def balanced_split(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Layers per stage (contiguous, each at least one) minimising the most expensive stage,
    `first` and `last` added to the first and last stage's cost."""
    n = len(costs)
    if stages > n:
        raise ValueError(f"{stages} stages for {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, k: int) -> float:  # layers [i, j) as stage k
        return prefix[j] - prefix[i] + (first if k == 0 else 0.0) + (last if k == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][j]: layers [0, j) in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j, k - 1))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    sizes, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage: its index and the blocks it runs."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    schedule: Schedule
    microbatches: int  # per pipeline pass
    sizes: tuple[int, ...]  # layers per stage
    per_rank: int = 0  # stages per pipeline rank (parallelism.pp_stages_per_rank); 0: the schedule's

    @property
    def stages_per_rank(self) -> int:
        return self.per_rank or self.schedule.stages_per_rank

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    def spans(self) -> list[StageSpan]:
        out, start = [], 0
        for k, n in enumerate(self.sizes):
            out.append(StageSpan(k, self.num_stages, range(start, start + n)))
            start += n
        return out

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank `pp_rank` runs, in order."""
        if self.schedule.v_shape:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def rank_spans(self, pp_rank: int) -> list[StageSpan]:
        spans = self.spans()
        return [spans[k] for k in self.stages_of(pp_rank)]

    def bubble(self) -> float:
        return self.schedule.bubble(self.pp, self.microbatches, self.stages_per_rank)

    def describe(self) -> str:
        return (f"pp={self.pp}, {self.schedule.name}, {self.num_stages} stages ({self.stages_per_rank} per rank) of {list(self.sizes)} layers, "
                f"{self.microbatches} micro-batches per pass")


def resolve(pp: int, schedule_name: str, microbatches: int, split: list[int], a: Qwen3Args, seq_len: int,
            step_microbatches: int, stages_per_rank: int = 0) -> PipelineLayout:
    """The layout `[parallelism]` asks for, checked against the model and the step.
    step_microbatches: the micro-batches of one optimizer step on each data-parallel rank;
    stages_per_rank: parallelism.pp_stages_per_rank (0: the schedule's own)."""
    s = schedule(schedule_name)
    v = stages_per_rank or s.stages_per_rank
    if v != s.stages_per_rank and (s.stages_per_rank == 1 or s.v_shape or v < 2):
        need = "exactly 2" if s.v_shape else ("1" if s.stages_per_rank == 1 else "at least 2")
        raise UserError(f"config key 'parallelism.pp_stages_per_rank' ({v}): pp_schedule '{s.name}' runs {need} "
                        "stages per rank; leave it at 0 to take the schedule's")
    stages = pp * v
    if stages > a.num_layers:
        raise UserError(f"parallelism.pp = {pp} with pp_schedule '{s.name}' makes {stages} stages "
                        f"({v} per rank), more than the model's {a.num_layers} layers; "
                        "lower parallelism.pp or pick a schedule with one stage per rank (1F1B, GPipe)")
    n = microbatches or step_microbatches
    if step_microbatches % n:
        raise UserError(f"config key 'parallelism.pp_microbatches' ({n}) must divide the step's {step_microbatches} "
                        "micro-batches per data-parallel rank (training.global_batch_size / (training.batch_size x "
                        "data-parallel ranks))")
    need = {"GPipe": 1, "DualPipeV": stages}.get(s.name, pp)
    if n < need or (v > 1 and n % pp):
        what = f"a multiple of parallelism.pp ({pp})" if v > 1 else f"at least parallelism.pp ({pp})"
        if need > pp:
            what = f"at least one per stage ({need}), in multiples of parallelism.pp ({pp}),"
        raise UserError(f"pp_schedule '{s.name}' needs {what} micro-batches per pipeline pass, got {n} "
                        "(parallelism.pp_microbatches, or the step's micro-batches when it is 0: raise "
                        "training.global_batch_size or lower training.batch_size)")
    if split:
        if len(split) != stages or sum(split) != a.num_layers or min(split) < 1:
            raise UserError(f"config key 'parallelism.pp_split' {split} must list {stages} stages' layer counts "
                            f"(pp {pp} x {v} per rank), each at least 1, adding up to the model's "
                            f"{a.num_layers} layers")
        sizes = tuple(split)
    else:
        costs, first, last = stage_costs(a, seq_len)
        sizes = tuple(balanced_split(costs, stages, first, last))
    return PipelineLayout(pp, s, n, sizes, stages_per_rank)


def check(cfg, dims, handle, step_microbatches: int) -> PipelineLayout | None:
    """preflight's pipeline checks: the layout `[parallelism]` asks for against the model, the
    step and what runs under pipeline parallelism yet (None when pp = 1)."""
    p = cfg.parallelism
    if dims.pp == 1:
        if p.pp_split:
            raise UserError(f"config key 'parallelism.pp_split' {p.pp_split} is set but parallelism.pp = 1; "
                            "leave it empty or raise parallelism.pp")
        return None
    arch = handle.args
    unsupported = [
        (handle.pipeline_modules is None, f"model.spec = '{handle.backend}' (it cannot be split into stages)"),
        (arch.tie_word_embeddings, "tied input and output embeddings (tie_word_embeddings: the first and the last "
                                "stage would share one matrix)"),
        (cfg.training.objective != "lm", f"training.objective = '{cfg.training.objective}'"),
        (p.compile, "parallelism.compile = true"),
        (bool(cfg.eval.tasks), "eval.tasks (lm-evaluation-harness runs the whole model on every rank)"),
        (bool(cfg.model.moe_bias_update_rate), "model.moe_bias_update_rate"),
    ]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"parallelism.pp = {dims.pp} is not supported together with {what} yet; set "
                            "parallelism.pp = 1 or change that setting")
    layout = resolve(dims.pp, p.pp_schedule, p.pp_microbatches, list(p.pp_split), arch, cfg.data.seq_len,
                     step_microbatches, p.pp_stages_per_rank)
    if layout.schedule.split_backward and (dims.dp > 1 or dims.cp > 1):
        # Its weight-gradient actions run after FSDP's post-backward, which would reduce-scatter
        # gradients that do not exist yet.
        raise UserError(f"pp_schedule '{layout.schedule.name}' splits the backward into input and weight "
                        f"gradients, which FSDP (data-parallel ranks: {dims.dp}, cp {dims.cp}) does not follow "
                        "yet; use 1F1B, GPipe, Interleaved1F1B or LoopedBFS with data or context parallelism")
    if handle.lora is not None:
        check_stages_train(layout, [t.key for t in handle.lora.all_targets])
    return layout


def check_stages_train(layout: PipelineLayout, adapter_keys: list[str]) -> None:
    """Every pipeline rank must train something: with LoRA, an adapter in one of its layers."""
    import re

    adapted = {int(m.group(1)) for k in adapter_keys if (m := re.search(r"\.layers\.(\d+)\.", k))}
    for r in range(layout.pp):
        layers = [i for s in layout.rank_spans(r) for i in s.layers]
        if not adapted & set(layers):
            raise UserError(f"pipeline rank {r} holds layers {layers[0]}-{layers[-1]}, where lora.target_modules "
                            "adapts nothing, so it would train nothing; widen lora.target_modules, or change "
                            "parallelism.pp_split or parallelism.pp")
