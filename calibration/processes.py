"""Processes calibration starts, bound to the process that starts them: a rank that hangs must
not hang its caller, and no rank may outlive it.

``die_with_parent`` asks Linux to SIGKILL the calling process when its parent dies
(``prctl(PR_SET_PDEATHSIG)``): a parent killed outright (SIGKILL, the OOM killer) runs no
cleanup of its own, so only the kernel can end its children then. ``spawn`` is
``torch.multiprocessing.spawn`` with a deadline: a gloo rank waiting on a peer that never
arrives would otherwise block ``join`` for gloo's own 30-minute timeout, or forever in a
barrier; past the deadline every rank still alive is stopped and a ``TimeoutError`` names what
timed out. The tests start their processes through ``die_with_parent`` too
(``tests/processes.py``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

#: how long ``spawn`` waits for its ranks unless told otherwise: a few tiny-model steps on a
#: CPU take seconds to a minute; ten minutes leaves room for a slow, shared machine
SPAWN_TIMEOUT_S = 600.0
#: how long a rank asked to stop (SIGTERM) gets before it is killed
STOP_GRACE_S = 5.0

_PR_SET_PDEATHSIG = 1
# resolved once, here: ``die_with_parent`` also runs between fork and exec (``preexec_fn``),
# where loading a library could block on a lock another thread of the parent held at fork
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing).

    ``parent`` is the pid the caller expects as parent: if it is gone already (it died before
    the request was made, and this process was handed to another), this process kills itself
    at once. The signal follows the parent *thread* that started this process, so start bound
    processes from a thread that outlives them (the main thread). Safe as a ``preexec_fn``.
    """
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _bound_rank(rank: int, fn: Callable[..., None], args: tuple[Any, ...], parent: int) -> None:
    """A spawned rank: bound to its parent (SIGKILL, not torch's own SIGINT, which a rank
    blocked in a collective does not see until the collective returns), then ``fn``."""
    die_with_parent(parent)
    fn(rank, *args)


def _stop(processes: list[Any], grace_s: float) -> None:
    """SIGTERM every live process, give them one shared ``grace_s``, SIGKILL the rest; all
    are reaped."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
        # SIGKILL cannot be ignored: the bound only guards a process stuck in the kernel
        process.join(grace_s)


def spawn(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    *,
    what: str,
    timeout_s: float | None = None,
    grace_s: float = STOP_GRACE_S,
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and wait at most ``timeout_s``
    for all of them (``fn`` must be importable by name, as for ``torch.multiprocessing``).

    A rank that raises or dies stops the others and raises as ``torch.multiprocessing.spawn``
    does (``ProcessRaisedException``, ``ProcessExitedException``). Past the deadline, a
    ``TimeoutError`` names ``what``, the deadline and the ranks still running (``timeout_s``
    None: ``SPAWN_TIMEOUT_S``, read at the call, so a caller that does not pass a deadline,
    ``calibration.frameworks.deepspeed.buffers``, can be given another). However it
    ends, no rank is left alive: each is bound to this process (``die_with_parent``) and
    stopped (SIGTERM, then SIGKILL after ``grace_s``) before this returns or raises.
    """
    from torch.multiprocessing.spawn import start_processes

    context = start_processes(  # type: ignore[no-untyped-call]
        _bound_rank,
        args=(fn, args, os.getpid()),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    timeout_s = SPAWN_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    try:
        # join returns as soon as any rank ends (False while others run): wait again with
        # what is left of the deadline
        while not context.join(max(0.0, deadline - time.monotonic()), grace_s):
            if time.monotonic() >= deadline:
                waiting = sorted(context.sentinels.values())  # the ranks not yet ended
                raise TimeoutError(
                    f"{what}: rank(s) {', '.join(map(str, waiting))} of {nprocs} still "
                    f"running after the {timeout_s:g} s deadline; stopped"
                )
    finally:
        _stop(context.processes, grace_s)
