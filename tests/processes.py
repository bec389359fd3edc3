"""The tests' one way to start a process that cannot outlive its test, and to bound it in time.

A killed test run must never hang the next one, so nothing a test starts may keep running
after it, however the test process ends. Three layers, because no single one reaches
everything:

- every child starts in a new session (its own process group: ending the group ends what it
  forked) and bound to the test process by ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
  (``headroom.calibration.processes.die_with_parent``): the kernel kills it when the test
  process dies, even by SIGKILL, which runs no cleanup at all;
- every process started from a guarded test process, by this module or not (the trainers a
  served supervisor starts, torchrun's ranks in sessions of their own, Slurm's daemons and job
  steps, Chromium under ChromeDriver), inherits ``TESTS_PROCESS_OWNER`` (the test process, as
  ``pid:start-ticks``) in its environment, and a child started here and what descends from it
  ``TESTS_PROCESS_TAG`` (which child): ``stop`` kills whatever carries the child's tag, however
  far from its process group it went;
- a watchdog (this file run as a script, in a session of its own) reads a pipe only the test
  process writes to: when the test process dies, however, the pipe closes and the watchdog
  kills every process carrying the owner's mark. ``guard`` also kills, at start, whatever an
  owner that is no longer alive left behind (a run killed together with its watchdog).

The marks are environment variables, read from ``/proc/PID/environ`` (Linux), not named
``HEADROOM_*`` so that no setting of the service ever reads them. A tag names its owner too
(``owner#n``): a process that rewrites its title over its environment (slurmstepd) may keep
only one of the two.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from headroom.calibration.processes import die_with_parent

#: the test process (``pid:start-ticks``) whose death ends the process carrying it
OWNER_VAR = "TESTS_PROCESS_OWNER"
#: the child of this module the process carrying it descends from (``owner#n``)
TAG_VAR = "TESTS_PROCESS_TAG"
#: how long a child asked to stop (SIGTERM) gets before it is killed
STOP_GRACE_S = 10.0
#: how long a sweep keeps killing marked processes (one may fork while the others die)
SWEEP_S = 5.0

_tags: dict[int, str] = {}  # pid of a child started here -> its tag
_count = itertools.count(1)
_watchdog: subprocess.Popen[bytes] | None = None


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of process ``pid``; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is parenthesised and may hold spaces: split after its closing paren
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def identity(pid: int) -> str:
    """``pid:start-ticks``: names process ``pid`` and no later process that reuses its pid."""
    stat = _stat(pid)
    if stat is None:
        raise ProcessLookupError(pid)
    return f"{pid}:{stat[1]}"


def alive(owner: str) -> bool:
    """Whether ``owner`` (``identity``) still names a running process; a zombie, dead but not
    yet reaped, is not running."""
    pid, _, ticks = owner.partition(":")
    stat = _stat(int(pid)) if pid.isdigit() else None
    return stat is not None and stat[1] == ticks and stat[0] != "Z"


def _environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with ({} if it is gone, a zombie, or not ours
    to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0") if entry)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def environs() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment it started with) of every process but this one."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != me:
            env = _environ(int(entry.name))
            if env:
                yield int(entry.name), env


def owner_of(env: Mapping[str, str]) -> str | None:
    """The owner a process's environment names: its owner mark, or the owner its tag was made
    by (a process that rewrites its title, as slurmstepd does, may overwrite the start of the
    environment ``/proc`` shows, so either mark may be all that is left)."""
    return env.get(OWNER_VAR) or env.get(TAG_VAR, "").partition("#")[0] or None


def marked(name: str, value: str) -> list[int]:
    """The processes (but this one) whose environment holds ``name=value``; for ``OWNER_VAR``,
    those whose either mark names ``value`` (``owner_of``)."""
    if name == OWNER_VAR:
        return [pid for pid, env in environs() if owner_of(env) == value]
    return [pid for pid, env in environs() if env.get(name) == value]


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process ``marked(name, value)``, and look again until none is left (one
    may fork while the others die) or ``SWEEP_S`` has passed; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + SWEEP_S
    while (pids := marked(name, value)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)
    return killed


def sweep_stale() -> list[int]:
    """Kill what owners that are no longer alive left running (an earlier test process killed
    along with its watchdog, or a parent killed before it could stop its children); the pids
    killed. A live owner's processes, another test run's on this machine, are left alone."""
    owners = {owner for _, env in environs() if (owner := owner_of(env)) is not None}
    return [pid for owner in owners if not alive(owner) for pid in kill_marked(OWNER_VAR, owner)]


def unmarked(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the marks: for a process that watches the tests (the watchdog)."""
    return {k: v for k, v in env.items() if k not in (OWNER_VAR, TAG_VAR)}


def _release(watchdog: subprocess.Popen[bytes]) -> None:
    """At a normal exit: close the watchdog's pipe and give it the time of one sweep."""
    if watchdog.stdin is not None:
        watchdog.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(timeout=SWEEP_S + 5)


def guard() -> str:
    """Make this process an owner, once: what it starts from now on, by any means, carries its
    mark (``os.environ``); what owners no longer alive left is killed; a watchdog kills
    whatever carries the mark once this process is gone. Returns the owner's mark."""
    global _watchdog
    owner = identity(os.getpid())
    if _watchdog is not None and os.environ.get(OWNER_VAR) == owner:
        return owner
    os.environ.pop(OWNER_VAR, None)  # inherited from a parent owner: set anew, at the end
    os.environ[OWNER_VAR] = owner
    sweep_stale()
    _watchdog = subprocess.Popen(
        [sys.executable, __file__, "--watch", owner],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=unmarked(os.environ),
        start_new_session=True,  # not in the tests' group: a Ctrl-C there must not end it first
    )
    atexit.register(_release, _watchdog)
    return owner


def child_options(env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """What binds a child: ``Popen``'s keyword arguments (``env``, this environment unless
    given, with the owner's mark and a new tag; a new session; death with this process) and
    the tag (``end`` kills what carries it). For a ``Popen`` made elsewhere (Selenium's)."""
    owner = guard()
    tag = f"{owner}#{next(_count)}"
    # the marks last: what overwrites the environment's start (a new process title) spares them
    marks = {OWNER_VAR: owner, TAG_VAR: tag}
    options: dict[str, Any] = {
        "env": {**unmarked(os.environ if env is None else env), **marks},
        "start_new_session": True,
        "preexec_fn": functools.partial(die_with_parent, os.getpid()),
    }
    return options, tag


def _in_turn(*steps: Callable[[], object]) -> None:
    """Run ``steps`` one after the other (a child's ``preexec_fn`` made of several)."""
    for step in steps:
        step()


def popen(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, **options: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **options)`` as a bound child (``child_options``); end it with
    ``stop``."""
    bound, tag = child_options(env)
    own = options.pop("preexec_fn", None)
    if own is not None:  # the caller's own (a resource limit) runs after the binding
        bound["preexec_fn"] = functools.partial(_in_turn, bound["preexec_fn"], own)
    proc: subprocess.Popen[Any] = subprocess.Popen(list(argv), **bound, **options)
    _tags[proc.pid] = tag
    return proc


def end(tag: str) -> list[int]:
    """Kill everything that carries ``tag`` (what a child started, wherever it is now)."""
    return kill_marked(TAG_VAR, tag)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """End a child started by ``popen`` and everything it started, and reap it: SIGTERM to its
    process group (none with ``grace_s`` 0), SIGKILL to the group after ``grace_s`` (the group
    may outlive its leader), then SIGKILL to whatever else carries its tag (descendants in
    sessions of their own, orphans, daemons). Stopping it again does nothing more."""
    tag = _tags.pop(proc.pid, None)
    if proc.poll() is None and grace_s > 0:
        _killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    if tag is None and proc.returncode is not None:
        return  # stopped before: its group id may be another's by now
    _killpg(proc.pid, signal.SIGKILL)
    # SIGKILL cannot be ignored: the bound only guards a process stuck in the kernel
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    if tag is not None:
        end(tag)


@contextlib.contextmanager
def started(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    grace_s: float = STOP_GRACE_S,
    **options: Any,
) -> Iterator[subprocess.Popen[Any]]:
    """A bound child (``popen``) for the ``with`` block, stopped (``stop``) when it ends,
    however it ends."""
    proc = popen(argv, env=env, **options)
    try:
        yield proc
    finally:
        stop(proc, grace_s)


def run(
    argv: Sequence[str], *, timeout: float, input: str | None = None, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` as a bound
    child. On timeout it and everything it started are killed (``subprocess.run`` kills the
    child alone: torchrun's ranks, in sessions of their own, would live on) and
    ``subprocess.TimeoutExpired`` carries what it wrote; afterwards nothing it started is
    left running."""
    stdin = subprocess.PIPE if input is not None else options.pop("stdin", None)
    proc = popen(
        argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options
    )
    try:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc, grace_s=0)
            try:  # whatever held its pipes is dead now
                out, err = proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                out, err = None, None
            raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
    finally:
        stop(proc)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def _watch(owner: str) -> None:
    """The watchdog: wait until the owner's end of the pipe closes (it has exited, however),
    then kill whatever carries its mark."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the tests
    sys.stdin.buffer.read()
    kill_marked(OWNER_VAR, owner)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--watch"]:
        _watch(sys.argv[2])
