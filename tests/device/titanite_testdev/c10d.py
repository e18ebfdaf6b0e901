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


def _to_host(x):
    """Host copies of a tensor, or of a (nested) list of them; CPU tensors are used as they are."""
    if isinstance(x, (list, tuple)):
        return [_to_host(e) for e in x]
    return x.detach().cpu() if x.device.type != "cpu" else x


def _write_back(originals, host) -> None:
    if isinstance(originals, (list, tuple)):
        for o, h in zip(originals, host, strict=True):
            _write_back(o, h)
    elif host is not originals:
        originals.copy_(host)


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

    def _staged(self, outputs, inputs, call) -> dist.Work:
        """Run gloo's `call(host_outputs, host_inputs)`, then copy the outputs back (in-place
        collectives pass their tensors as outputs and no inputs)."""
        host_out, host_in = _to_host(outputs), _to_host(inputs)
        call(host_out, host_in).wait()
        _write_back(outputs, host_out)
        return _done(outputs)

    # ---- collectives: gloo's, on host copies ----
    def allreduce(self, tensors, opts=None):
        return self._staged(list(tensors), [], lambda o, _: self._gloo.allreduce(o, opts or dist.AllreduceOptions()))

    def broadcast(self, tensors, opts=None):
        return self._staged(list(tensors), [], lambda o, _: self._gloo.broadcast(o, opts or dist.BroadcastOptions()))

    def reduce(self, tensors, opts=None):
        return self._staged(list(tensors), [], lambda o, _: self._gloo.reduce(o, opts or dist.ReduceOptions()))

    def allgather(self, output_lists, inputs, opts=None):
        return self._staged(output_lists, list(inputs),
                            lambda o, i: self._gloo.allgather(o, i, opts or dist.AllgatherOptions()))

    def _allgather_base(self, output, input, opts=None):
        return self._staged(output, input,
                            lambda o, i: self._gloo._allgather_base(o, i, opts or dist.AllgatherOptions()))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self._allgather_base(o, i, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._staged(list(outputs), input_lists,
                            lambda o, i: self._gloo.reduce_scatter(o, i, opts or dist.ReduceScatterOptions()))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._staged(output, input,
                            lambda o, i: self._gloo._reduce_scatter_base(o, i, opts or dist.ReduceScatterOptions()))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(o, i, opts)
        return _done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._staged(output, input, lambda o, i: self._gloo.alltoall_base(
            o, i, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        return self._staged(list(outputs), list(inputs),
                            lambda o, i: self._gloo.alltoall(o, i, opts or dist.AllToAllOptions()))

    def gather(self, output_lists, inputs, opts=None):
        return self._staged(output_lists, list(inputs),
                            lambda o, i: self._gloo.gather(o, i, opts or dist.GatherOptions()))

    def scatter(self, outputs, input_lists, opts=None):
        return self._staged(list(outputs), input_lists,
                            lambda o, i: self._gloo.scatter(o, i, opts or dist.ScatterOptions()))

    def send(self, tensors, dst, tag=0):
        return self._staged([], list(tensors), lambda _, i: self._gloo.send(i, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._staged(list(tensors), [], lambda o, _: self._gloo.recv(o, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._staged(list(tensors), [], lambda o, _: self._gloo.recv_anysource(o, tag))

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
