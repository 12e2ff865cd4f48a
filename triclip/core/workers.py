"""Worker processes that end with their parent.

A ``multiprocessing`` pool's workers outlive a parent killed by SIGKILL (no Python code runs there to stop them):
each goes on with the job it holds, and a pool that writes files then writes into a folder its parent no longer
owns. :func:`die_with_parent`, a pool's ``initializer``, asks Linux to SIGKILL the worker the moment its parent
ends (``prctl(PR_SET_PDEATHSIG)``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None) -> None:
    """In a worker: be killed (SIGKILL) when the parent process ends; ``parent``: its pid, checked after the
    request, since a parent that died before it is not watched (the worker then ends at once)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the pool behaves as before
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
