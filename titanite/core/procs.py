"""No process outlives its run: the processes titanite starts die with the process that started
them, however it dies (SIGKILL included).

- `die_with_parent(parent_pid)`, called first thing in a child, asks Linux to SIGKILL the child
  when its parent exits (`prctl(PR_SET_PDEATHSIG)`), and exits at once where the parent died
  before the call (the child's parent pid is no longer `parent_pid`). A no-op on other systems.
- `forkserver_context(preload)` is multiprocessing's forkserver context for worker pools (`data
  prepare --workers N`): the server process dies with this process, and each worker it forks
  dies with the server, so a killed prepare leaves neither behind (without this, SIGKILL left the
  server, both workers and multiprocessing's resource tracker running: each worker holds both ends
  of the pool's task pipe and never sees it close, and the server waits for its workers). The
  resource tracker needs nothing: it exits when the last of them has gone.

Linux sends the parent-death signal when the *thread* that started the child exits: start pools
and child processes from a thread that lives as long as the process (the main thread), never
from a short-lived one. Threads need none of this: they die with their process (titanite's are
daemon threads, so none holds up an exit either).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from multiprocessing.context import BaseContext

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "TITANITE_FORKSERVER_PARENT"  # the pid the forkserver must find as its parent
_FORKSERVER_HOOK = "titanite.core.procs_forkserver"


def die_with_parent(parent_pid: int | None) -> bool:
    """SIGKILL this process when its parent exits (Linux); if its parent is already not
    `parent_pid` (it died before this call, and this process was handed to another), die now.
    Returns whether the signal is armed (False off Linux, or where prctl is refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        return False
    if armed and parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # what the signal would have done, had it been set in time
    return armed


def forkserver_context(preload: list[str]) -> BaseContext:
    """The forkserver context, with `preload` imported in the server once (each worker forks with
    it loaded), the server dying with this process and its workers with the server.

    The server is one per process, started on first use: these settings apply if titanite starts
    it, which it does unless other code in this process used a forkserver first."""
    os.environ[PARENT_ENV] = str(os.getpid())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([_FORKSERVER_HOOK, *preload])  # the hook first: the shortest window
    return context
