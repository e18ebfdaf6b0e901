"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut to this rank's stages (models/stage.py: the blocks keep their names, so
checkpoints are the same tensors under every layout) and each stage becomes a
`PipelineStage` over a small module that runs its part of the model through the model's own
call (so FSDP's hooks on the model and its blocks run as without pipelining). The schedule
(`parallelism.pp_schedule`) moves the micro-batches through the stages: every stage gets each
micro-batch's positions, labels and document ids as keyword arguments, and the first stage its
token ids; hidden states travel between stages.

The loss of a micro-batch is its summed cross-entropy divided by the valid labels of the whole
step (on every data-parallel and context-parallel rank), as without pipelining, so the
schedule sums the gradients unscaled. The last stage holds the losses; the step's total is summed
over the pipeline ranks (the others add zero), then over the data-parallel ranks as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from titanite.models.handle import ModelHandle
from titanite.models.stage import Part, module_at
from titanite.parallel.distributed import World
from titanite.parallel.pipeline_layout import PipelineLayout

# after a stage's forward: (its part, its output, the micro-batch's index in the step as an int64
# [1] host tensor) -> the output to pass on (e.g. with a loss share attached)
OnForward = Callable[[Part, torch.Tensor, torch.Tensor], torch.Tensor]
# what runs around a stage's forward: (its part, the micro-batch's index (int64 [1] on the host),
# the micro-batch's tensors) -> a context (context parallelism's layout, the dropout seed)
Context = Callable[[Part, torch.Tensor, dict[str, torch.Tensor]], contextlib.AbstractContextManager]
LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, labels) -> loss sum


class StageModule(nn.Module):
    """One stage's forward: the handle's `forward_part` on this stage's part. Its parameters
    (what a zero-bubble schedule computes weight gradients for) are those of the part's modules;
    the model itself is not a child, so nothing is registered twice."""

    def __init__(self, handle: ModelHandle, part: Part, on_forward: OnForward | None = None,
                 context: Context | None = None) -> None:
        super().__init__()
        self.__dict__["handle"] = handle  # not a submodule
        self.part = part
        self.on_forward = on_forward
        self.context = context

    def forward(self, x: torch.Tensor, micro: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        """x: token ids (first stage) or hidden states; micro: the micro-batch's index in the step
        ([1]); batch: the micro-batch's other tensors (position_ids, labels, document ids, ...)."""
        with self.context(self.part, micro, batch) if self.context is not None else contextlib.nullcontext():
            out = self.handle.forward_part(x, batch, self.part)
            return out if self.on_forward is None else self.on_forward(self.part, out, micro)

    def part_modules(self) -> list[nn.Module]:
        layers, firsts, lasts = self.handle.pipeline_modules
        root = self.handle.module
        mods = [root.get_submodule(layers)[i] for i in self.part.layers]
        named = (list(firsts) if self.part.first else []) + (list(lasts) if self.part.last else [])
        return mods + [m for m in (module_at(root, name) for name in named) if m is not None]

    def parameters(self, recurse: bool = True):
        seen: set[int] = set()
        for m in self.part_modules():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


class Pipeline:
    """This rank's stages, the schedule that trains them, and a forward-only pass (the MoE
    counting pass, evaluation)."""

    def __init__(self, handle: ModelHandle, world: World, layout: PipelineLayout,
                 on_forward: OnForward | None = None, context: Context | None = None) -> None:
        self.handle, self.world, self.layout = handle, world, layout
        self.on_forward = on_forward
        spans = layout.rank_spans(world.pp_rank)
        self.spans = spans
        self.parts = [Part(s.layers, s.first, s.last) for s in spans]
        self.modules = [StageModule(handle, p, on_forward, context) for p in self.parts]
        self.is_last = any(p.last for p in self.parts)
        self._loss_of: LossOf | None = None
        self._train = None
        self._told: set[tuple[int, ...]] = set()  # forward_only's boundaries whose receiver knows the shape
        self._shapes: dict[tuple[int, ...], tuple[torch.Size, torch.dtype]] = {}

    def _schedule(self, n: int):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        group = self.world.meshes["pp"].get_group()
        stages = [PipelineStage(m, s.index, s.num_stages, self.world.device, group=group)
                  for m, s in zip(self.modules, self.spans)]
        cls = get_schedule_class(self.layout.schedule.name)
        return cls(stages[0] if len(stages) == 1 else stages, n, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self._loss_of is not None
        return self._loss_of(output, labels)

    @staticmethod
    def _inputs(batches: list[dict[str, torch.Tensor]], first: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        ids = whole["input_ids"]
        micro = torch.arange(first, first + len(batches))  # split one per micro-batch; on the host
        return ids, {"micro": micro, **{k: v for k, v in whole.items() if k != "input_ids"}}

    def step(self, batches: list[dict[str, torch.Tensor]], loss_of: LossOf, first: int = 0) -> torch.Tensor:
        """Forward and backward of `batches` (one pass: layout.microbatches of them) on this
        rank's stages; the sum of their losses (`loss_of`, detached) on the last stage, zero on
        the others."""
        if self._train is None:
            self._train = self._schedule(self.layout.microbatches)
        assert len(batches) == self.layout.microbatches, (len(batches), self.layout.microbatches)
        ids, kwargs = self._inputs(batches, first)
        losses: list[torch.Tensor] = []
        self._loss_of = loss_of
        args = (ids,) if any(p.first for p in self.parts) else ()
        target = kwargs["labels"] if self.is_last else None
        try:
            self._train.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._loss_of = None
        if not losses:
            return torch.zeros((), device=self.world.device)
        return torch.stack([l.detach().float() for l in losses]).sum()

    def forward_only(self, batches: list[dict[str, torch.Tensor]], first: int = 0) -> list[torch.Tensor]:
        """The forwards of `batches` without gradients, stage after stage, under any placement
        of the stages: each stage receives all its inputs, runs them, then sends all its outputs,
        so every pair of ranks sends and receives in the same order (no deadlock, whether
        point-to-point operations complete eagerly or in issue order). What the stages' forwards
        record is what the training pass will compute. The last stage's outputs on the rank
        that runs it, else []."""
        holder = {k: r for r in range(self.layout.pp) for k in self.layout.stages_of(r)}
        me = self.world.pp_rank
        kept: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        with torch.no_grad():
            for module, span in sorted(zip(self.modules, self.spans), key=lambda ms: ms[1].index):
                if span.first:
                    inputs = [b["input_ids"] for b in batches]
                elif holder[span.index - 1] == me:  # the previous stage ran on this rank
                    inputs = kept
                else:
                    inputs = [self._receive(holder[span.index - 1], span.index - 1, b) for b in batches]
                outs = [module(x, torch.tensor([first + i]), **{k: v for k, v in b.items() if k != "input_ids"})
                        for i, (x, b) in enumerate(zip(inputs, batches))]
                kept = outs
                if span.last:
                    outputs = outs
                elif holder[span.index + 1] != me:
                    for out, b in zip(outs, batches):
                        self._hand_on(out, holder[span.index + 1], span.index, b)
        return outputs

    def _channel(self, boundary: int, batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """What both sides of a stage boundary know of a micro-batch's hidden states without
        telling each other: the boundary and the batch's shape."""
        return (boundary, *batch["input_ids"].shape)

    def _hand_on(self, out: torch.Tensor, pp_rank: int, boundary: int, batch: dict[str, torch.Tensor]) -> None:
        """Send a stage's output to the next stage's rank: its shape and dtype the first time this
        boundary carries a batch of this shape (the receiver keeps them), then the data."""
        import torch.distributed as dist

        dst = dist.get_global_rank(self.world.meshes["pp"].get_group(), pp_rank)
        key = self._channel(boundary, batch)
        if key not in self._told:
            self._told.add(key)
            _send("", out, dst, self.world.device)
        else:
            dist.send(out.contiguous(), dst=dst)

    def _receive(self, pp_rank: int, boundary: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist

        src = dist.get_global_rank(self.world.meshes["pp"].get_group(), pp_rank)
        key = self._channel(boundary, batch)
        if key not in self._shapes:  # the only host read: once per boundary and batch shape
            t = _recv(src, self.world.device)[1]
            self._shapes[key] = (t.shape, t.dtype)
            return t
        shape, dtype = self._shapes[key]
        t = torch.empty(shape, dtype=dtype, device=self.world.device)
        dist.recv(t, src=src)
        return t

    def evaluate(self, batch: dict[str, torch.Tensor], loss_of: LossOf) -> torch.Tensor:
        """The forward of one batch (no gradients); its loss on the last stage, zero elsewhere."""
        outputs = self.forward_only([batch])
        if not outputs:
            return torch.zeros((), device=self.world.device)
        with torch.no_grad():
            return loss_of(outputs[0], batch["labels"]).detach().float()


# -- exports: every stage's tensors written by rank 0 ---------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8]
_HEADER = 12  # name length, dtype, ndim, up to 9 dims


def to_rank_zero(world: World, tensors: Callable[[Callable], Iterator[tuple[str, torch.Tensor]]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) pairs of every pipeline rank's stages, yielded on rank 0 (nothing on the
    others, which must still run the generator to its end). `tensors(regions)` is a handle's
    hf_state_dict walk; each pipeline rank's walk gathers its tensors inside its own stage
    ranks (to their first rank), which sends them to rank 0, one tensor at a time."""
    import functools

    import torch.distributed as dist

    from titanite.parallel.distributed import regions_to_rank_zero

    stage = world.meshes["stage"].get_group()
    pp_group = world.meshes["pp"].get_group()
    regions = functools.partial(regions_to_rank_zero, group=stage)
    leader, zero = dist.get_rank(stage) == 0, dist.get_rank() == 0
    device = world.device
    for r in range(world.pp):
        if world.pp_rank == r:
            for key, t in tensors(regions):
                if not leader:
                    continue
                if zero:
                    yield key, t
                else:
                    _send(key, t, dist.get_global_rank(pp_group, 0), device)
            if leader and not zero:
                _send(None, None, dist.get_global_rank(pp_group, 0), device)
        elif zero:
            src = dist.get_global_rank(pp_group, r)
            while (got := _recv(src, device)) is not None:
                yield got


def _send(key: str | None, t: torch.Tensor | None, dst: int, device: torch.device) -> None:
    """Send a named tensor (None: the end of a stream) to `dst`: a header, the name, the data."""
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64)
    parts = [header]
    if key is None:  # the end
        header[0] = -1
    else:
        name = torch.tensor(list(key.encode()), dtype=torch.uint8)
        header[:3] = torch.tensor([len(name), _DTYPES.index(t.dtype), t.ndim])
        header[3:3 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        parts += ([name] if len(name) else []) + [t.contiguous()]
    for p in parts:
        dist.send(p.to(device), dst=dst)


def _recv(src: int, device: torch.device) -> tuple[str, torch.Tensor] | None:
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src)
    n, dtype, ndim = (int(v) for v in header[:3].tolist())
    if n < 0:
        return None
    name = torch.zeros(n, dtype=torch.uint8, device=device)
    if n:
        dist.recv(name, src=src)
    t = torch.empty([int(v) for v in header[3:3 + ndim].tolist()], dtype=_DTYPES[dtype], device=device)
    dist.recv(t, src=src)
    return bytes(name.cpu().tolist()).decode(), t
