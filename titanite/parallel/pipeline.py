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

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from titanite.models.handle import ModelHandle
from titanite.models.stage import Part
from titanite.parallel.distributed import World
from titanite.parallel.pipeline_layout import PipelineLayout

log = logging.getLogger("titanite")

# after a stage's forward: (its part, its output, the micro-batch's index in the step as an int64
# [1] device tensor) -> the output to pass on (e.g. with a loss share attached)
OnForward = Callable[[Part, torch.Tensor, torch.Tensor], torch.Tensor]
LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, labels) -> loss sum


class StageModule(nn.Module):
    """One stage's forward: the handle's `forward_part` on this stage's part. Its parameters
    (what a zero-bubble schedule computes weight gradients for) are those of the part's modules;
    the model itself is not a child, so nothing is registered twice."""

    def __init__(self, handle: ModelHandle, part: Part, on_forward: OnForward | None = None) -> None:
        super().__init__()
        self.__dict__["handle"] = handle  # not a submodule
        self.part = part
        self.on_forward = on_forward

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, micro: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch = {"position_ids": position_ids, "labels": labels}
        if document_ids is not None:
            batch["document_ids"] = document_ids
        out = self.handle.forward_part(x, batch, self.part)
        return out if self.on_forward is None else self.on_forward(self.part, out, micro)

    def part_modules(self) -> list[nn.Module]:
        layers, firsts, lasts = self.handle.pipeline_modules
        root = self.handle.module
        mods = [root.get_submodule(layers)[i] for i in self.part.layers]
        named = (list(firsts) if self.part.first else []) + (list(lasts) if self.part.last else [])
        for name in named:
            parent, _, attr = name.rpartition(".")
            m = getattr(root.get_submodule(parent) if parent else root, attr)
            if m is not None:
                mods.append(m)
        return mods

    def parameters(self, recurse: bool = True):
        seen: set[int] = set()
        for m in self.part_modules():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


class Pipeline:
    """This rank's stages and the schedules that run them (one for training, a forward-only one
    for evaluation)."""

    def __init__(self, handle: ModelHandle, world: World, layout: PipelineLayout,
                 on_forward: OnForward | None = None) -> None:
        self.handle, self.world, self.layout = handle, world, layout
        self.on_forward = on_forward
        spans = layout.rank_spans(world.pp_rank)
        self.spans = spans
        self.parts = [Part(s.layers, s.first, s.last) for s in spans]
        self.modules = [StageModule(handle, p, on_forward) for p in self.parts]
        self.is_last = any(p.last for p in self.parts)
        self._loss_of: LossOf | None = None
        self._train = None
        self._count = None
        self._eval = None

    def _schedule(self, n: int, training: bool):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        group = self.world.meshes["pp"].get_group()
        stages = [PipelineStage(m, s.index, s.num_stages, self.world.device, group=group)
                  for m, s in zip(self.modules, self.spans)]
        name = self.layout.schedule.name
        if not training:  # forward only: the simplest schedule that runs this placement
            name = "GPipe" if len(stages) == 1 else "LoopedBFS"
            if self.layout.schedule.v_shape:
                name = "ZBVZeroBubble"
        cls = get_schedule_class(name)
        kw = {"loss_fn": self._loss, "scale_grads": False}
        return cls(stages[0] if len(stages) == 1 else stages, n, **kw)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self._loss_of is not None
        return self._loss_of(output, labels)

    @staticmethod
    def _inputs(batches: list[dict[str, torch.Tensor]], first: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        ids = whole["input_ids"]
        micro = torch.arange(first, first + len(batches), device=ids.device)  # split one per micro-batch
        kwargs = {"position_ids": whole["position_ids"], "labels": whole["labels"], "micro": micro}
        if "document_ids" in whole:
            kwargs["document_ids"] = whole["document_ids"]
        return ids, kwargs

    def step(self, batches: list[dict[str, torch.Tensor]], loss_of: LossOf, first: int = 0) -> torch.Tensor:
        """Forward and backward of `batches` (one pass: layout.microbatches of them) on this
        rank's stages; the sum of their losses (`loss_of`, detached) on the last stage, zero on
        the others."""
        if self._train is None:
            self._train = self._schedule(self.layout.microbatches, training=True)
        assert len(batches) == self.layout.microbatches, (len(batches), self.layout.microbatches)
        return self._run(self._train, batches, loss_of, True, first)

    def forward_only(self, batches: list[dict[str, torch.Tensor]], first: int = 0) -> None:
        """The forwards of one pass's `batches` through the training schedule, without gradients
        (what the stages' forwards record is what the training pass will compute)."""
        if self._count is None:  # its own schedule: one that switched modes would re-infer shapes each time
            self._count = self._schedule(self.layout.microbatches, training=True)
        with torch.no_grad():
            self._run(self._count, batches, lambda out, labels: out.detach().sum(), False, first)

    def evaluate(self, batch: dict[str, torch.Tensor], loss_of: LossOf) -> torch.Tensor:
        """The forward of one batch (no gradients); its loss on the last stage, zero elsewhere."""
        if self._eval is None:
            self._eval = self._schedule(1, training=False)
        with torch.no_grad():
            return self._run(self._eval, [batch], loss_of, False, 0)

    def _run(self, schedule, batches, loss_of: LossOf, training: bool, first_micro: int) -> torch.Tensor:
        ids, kwargs = self._inputs(batches, first_micro)
        labels = kwargs["labels"]
        losses: list[torch.Tensor] = []
        self._loss_of = loss_of
        first = any(p.first for p in self.parts)
        args = (ids,) if first else ()
        target = labels if self.is_last else None
        try:
            if training:
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._loss_of = None
        device = self.world.device
        if not losses:
            return torch.zeros((), device=device)
        return torch.stack([l.detach().float() for l in losses]).sum()


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
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64)
    if key is None:  # the end
        header[0] = -1
        dist.send(header.to(device), dst=dst)
        return
    name = torch.tensor(list(key.encode()), dtype=torch.uint8)
    header[:3] = torch.tensor([len(name), _DTYPES.index(t.dtype), t.ndim])
    header[3:3 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header.to(device), dst=dst)
    dist.send(name.to(device), dst=dst)
    dist.send(t.contiguous().to(device), dst=dst)


def _recv(src: int, device: torch.device) -> tuple[str, torch.Tensor] | None:
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src)
    n, dtype, ndim = (int(v) for v in header[:3].tolist())
    if n < 0:
        return None
    name = torch.zeros(n, dtype=torch.uint8, device=device)
    dist.recv(name, src=src)
    t = torch.empty([int(v) for v in header[3:3 + ndim].tolist()], dtype=_DTYPES[dtype], device=device)
    dist.recv(t, src=src)
    return bytes(name.cpu().tolist()).decode(), t
