"""Launcher backends: how a run of the bundled trainer becomes a process.

A backend turns the trainer's arguments into an argument vector and starts it in a new session
(its own process group, so cancelling ends the trainer and everything it started), with stdout
and stderr captured in the run's log and umask 077 (what it writes is private). No shell is
involved and only ``headroom train`` is ever run: the arguments name files the launch wrote
itself (the validated model and training specs) and numbers. A cluster engine plugs in as
another ``Launcher``: ``argv`` for what to run and ``start`` for how.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol, TypeAlias

#: how a run starts: a process of this host (``local``, ``torchrun``) or a Slurm batch job
#: (``slurm``: submitted by the supervisor through ``launch.slurm``, not started here)
BACKENDS = ("local", "torchrun", "slurm")
#: exit code of ``headroom train`` when the device ran out of memory (a caller steps down)
EXIT_OOM = 3
#: the trainer's umask: what it writes into its run directory is its user's alone
TRAINER_UMASK = 0o077


class Launcher(Protocol):
    """A way to start the trainer."""

    name: str

    def argv(self, trainer_args: list[str]) -> list[str]:
        """The full argument vector that runs ``headroom train`` with ``trainer_args``."""
        ...

    def start(
        self, trainer_args: list[str], log: IO[bytes], cwd: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Start the trainer in a new process group, output into ``log``."""
        ...


class LocalLauncher:
    """The trainer as a subprocess of this interpreter."""

    name = "local"

    def argv(self, trainer_args: list[str]) -> list[str]:
        return [sys.executable, "-m", "headroom", "train", *trainer_args]

    def start(
        self, trainer_args: list[str], log: IO[bytes], cwd: Path, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(trainer_args),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            umask=TRAINER_UMASK,
        )


class TorchrunLauncher(LocalLauncher):
    """The trainer under ``torchrun``: one node, ``nproc`` processes (the run's ``parallel.dp``
    data-parallel ranks)."""

    name = "torchrun"

    def __init__(self, nproc: int = 1) -> None:
        self.nproc = nproc

    def argv(self, trainer_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "headroom",
            "train",
            *trainer_args,
        ]


def launcher(name: str, ranks: int = 1) -> Launcher:
    """The backend called ``name`` (``local`` or ``torchrun``, of ``ranks`` processes)."""
    if name == "local":
        return LocalLauncher()
    if name == "torchrun":
        return TorchrunLauncher(ranks)
    raise ValueError(
        f"backend: unknown launcher {name!r}; allowed: local, torchrun (slurm runs are submitted "
        "as jobs)"
    )


def describe_exit(code: int) -> str:
    """A person's reading of a trainer's exit status (negative: killed by that signal)."""
    if code == 0:
        return "completed"
    if code == EXIT_OOM:
        return f"out of memory (exit {EXIT_OOM})"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return f"exited with code {code} ({signal.Signals(code - 128).name} in a child)"
    return f"exited with code {code}"


def process_cmdline(pid: int) -> str:
    """The command line of process ``pid`` ('' if it is gone)."""
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is parenthesised and may hold spaces: split after its closing paren
    return int(stat.rsplit(")", 1)[1].split()[19])


#: a process group to end: the ``Popen`` of a trainer we started (the group's leader, reaped
#: here), or the group id of one we did not start (an orphan that someone else reaps)
Group: TypeAlias = subprocess.Popen[bytes] | int


def _pgid(group: Group) -> int:
    """The process group id: a child we started leads its own group."""
    return group.pid if isinstance(group, subprocess.Popen) else group


def _group_gone(group: Group) -> bool:
    """Whether nothing of ``group`` is left. Our own child is reaped first: until it is waited
    for it stays a zombie, still a member of its group, and the group would look alive."""
    if isinstance(group, subprocess.Popen):
        group.poll()
    try:
        os.killpg(_pgid(group), 0)
    except (ProcessLookupError, PermissionError):  # Permission: the id is someone else's now
        return True
    return False


def end_process_groups(groups: Sequence[Group], grace_s: float = 5.0) -> list[bool]:
    """SIGTERM every group at once, wait one shared ``grace_s`` for all of them, then SIGKILL
    what is left; per group, True if it was alive. A ``Popen`` is reaped (its ``returncode``
    set), so a trainer that exits on SIGTERM is seen gone at once."""
    alive = []
    for group in groups:
        try:
            os.killpg(_pgid(group), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):  # gone, or the id is someone else's now
            alive.append(False)
        else:
            alive.append(True)
    waiting = [g for g, a in zip(groups, alive, strict=True) if a]
    deadline = time.monotonic() + grace_s
    while waiting:
        waiting = [g for g in waiting if not _group_gone(g)]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    for group in waiting:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_pgid(group), signal.SIGKILL)
    for group in waiting:
        if isinstance(group, subprocess.Popen):
            # SIGKILL cannot be ignored; the bound only guards a process stuck in the kernel
            with contextlib.suppress(subprocess.TimeoutExpired):
                group.wait(timeout=grace_s)
    return alive


def end_process_group(group: Group, grace_s: float = 5.0) -> bool:
    """SIGTERM the group, then SIGKILL what is left after ``grace_s``; True if it was alive
    (``end_process_groups`` for one group)."""
    return end_process_groups([group], grace_s)[0]
