"""Imported only by multiprocessing's forkserver process, as the first of its preload modules
(`procs.forkserver_context`), never elsewhere: importing it ties the importing process to its
parent. The server dies with the titanite process that started it (whose pid that process put in
`PARENT_ENV`), and every worker the server forks dies with the server, the signal armed in the
worker right after the fork, before any of its own code runs.
"""

from __future__ import annotations

import os

from titanite.core.procs import PARENT_ENV, die_with_parent

_parent = os.environ.get(PARENT_ENV)
die_with_parent(int(_parent) if _parent and _parent.isdigit() else None)

_SERVER_PID = os.getpid()
os.register_at_fork(after_in_child=lambda: die_with_parent(_SERVER_PID))
