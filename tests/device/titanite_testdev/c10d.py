"""`tdevccl`: the test device's collectives, as a vendor's collective library would provide them.

c10d's `Backend` has no Python constructor, so a backend written in Python is a
`ProcessGroup` subclass. This one stages tdev tensors through an inner gloo group: copy to the
host, run gloo's collective, copy the result back. It replaces the whole process group, so it
carries CPU tensors too (DCP's object collectives). `TITANITE_TESTDEV_C10D=0` leaves it
unregistered: a device with no c10d backend.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

NAME = "tdevccl"


def _done(result=None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Staged:
    """Host copies of a list of tensors, written back to the originals after the collective."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.originals = tensors
        self.host = [t.detach().cpu() if t.device.type != "cpu" else t for t in tensors]

    def write_back(self) -> None:
        for orig, host in zip(self.originals, self.host, strict=True):
            if host is not orig:
                orig.copy_(host)


class TdevProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("tdevccl-gloo/", store), rank, size, timeout)
        self._name = ""

    # c10d and DeviceMesh name groups after creation; a Python group keeps its own name.
    def getBackendName(self) -> str:
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def _run(self, tensors: list[torch.Tensor], call) -> dist.Work:
        staged = _Staged(tensors)
        call(staged.host).wait()
        staged.write_back()
        return _done(tensors)

    def _run_io(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], call) -> dist.Work:
        out, inp = _Staged(outputs), _Staged(inputs)
        call(out.host, inp.host).wait()
        out.write_back()
        return _done(outputs)

    # ---- collectives ----
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._run(list(tensors), lambda h: self._gloo.allreduce(h, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._run(list(tensors), lambda h: self._gloo.broadcast(h, opts))

    def reduce(self, tensors, opts=None):
        return self._run(list(tensors), lambda h: self._gloo.reduce(h, opts or dist.ReduceOptions()))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        outs = [_Staged(list(lst)) for lst in output_lists]
        inp = _Staged(list(inputs))
        self._gloo.allgather([o.host for o in outs], inp.host, opts).wait()
        for o in outs:
            o.write_back()
        return _done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run_io([output], [input], lambda o, i: self._gloo._allgather_base(o[0], i[0], opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self._allgather_base(o, i, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out = _Staged(list(outputs))
        ins = [_Staged(list(lst)) for lst in input_lists]
        self._gloo.reduce_scatter(out.host, [i.host for i in ins], opts).wait()
        out.write_back()
        return _done(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run_io([output], [input], lambda o, i: self._gloo._reduce_scatter_base(o[0], i[0], opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(o, i, opts)
        return _done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run_io([output], [input], lambda o, i: self._gloo.alltoall_base(
            o[0], i[0], output_split_sizes, input_split_sizes, opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run_io(list(outputs), list(inputs), lambda o, i: self._gloo.alltoall(o, i, opts))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        outs = [_Staged(list(lst)) for lst in output_lists]
        inp = _Staged(list(inputs))
        self._gloo.gather([o.host for o in outs], inp.host, opts).wait()
        for o in outs:
            o.write_back()
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        out = _Staged(list(outputs))
        ins = [_Staged(list(lst)) for lst in input_lists]
        self._gloo.scatter(out.host, [i.host for i in ins], opts).wait()
        out.write_back()
        return _done(outputs)

    def send(self, tensors, dst, tag=0):
        staged = _Staged(list(tensors))
        self._gloo.send(staged.host, dst, tag).wait()
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        return self._run(list(tensors), lambda h: self._gloo.recv(h, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._run(list(tensors), lambda h: self._gloo.recv_anysource(h, tag))

    def barrier(self, opts=None):
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return _done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self._gloo.monitored_barrier(timeout, wait_all_ranks)


def _create(store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    return TdevProcessGroup(store, rank, size, timeout)


def register() -> None:
    if os.environ.get("TITANITE_TESTDEV_C10D", "1") == "0":
        return
    if getattr(dist.Backend, NAME.upper(), None) is None:  # once per process
        dist.Backend.register_backend(NAME, _create, devices=["tdev"])
