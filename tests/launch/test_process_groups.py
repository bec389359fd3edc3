"""Ending trainers' process groups: a child that exits on SIGTERM is seen gone at once (it is
reaped, not polled as a zombie until the grace runs out), several are ended together within one
grace period, and one that ignores SIGTERM is killed when the grace is over.

Shutting down used to wait the whole 5 s grace per trainer, one after another: three trainers
took 15 s, past Docker's 10 s stop timeout, and ``headroom launch`` Ctrl-C took 5 s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import processes
import pytest
from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.launch import RunPlan, Supervisor, queue_run, transitions
from headroom.launch.backends import end_process_group, end_process_groups
from headroom.launch.supervisor import Child

#: sleeps until a signal ends it (SIGTERM's default action: exit at once)
POLITE = "import sys, time; print('ready', flush=True); time.sleep(120)"
#: ignores SIGTERM: only SIGKILL ends it
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)


def _start(code: str) -> subprocess.Popen[bytes]:
    """A child in its own process group, as the launcher starts the trainer, once it is ready
    (bound to this process: ``processes.popen``)."""
    proc = processes.popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:  # whatever a failing test left behind
        processes.stop(proc, grace_s=0)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_child_that_exits_on_sigterm_is_reaped_at_once(
    children: list[subprocess.Popen[bytes]],
) -> None:
    children.append(proc := _start(POLITE))
    began = time.monotonic()
    assert end_process_group(proc, grace_s=5) is True
    assert time.monotonic() - began < 1
    assert proc.returncode == -signal.SIGTERM  # reaped here, the exit status kept
    assert end_process_group(proc, grace_s=5) is False  # already gone


def test_three_children_end_together_well_under_a_second(
    children: list[subprocess.Popen[bytes]],
) -> None:
    children.extend(_start(POLITE) for _ in range(3))
    began = time.monotonic()
    assert end_process_groups(children, grace_s=5) == [True, True, True]
    assert time.monotonic() - began < 1
    assert [p.returncode for p in children] == [-signal.SIGTERM] * 3


@pytest.mark.timing  # one grace of 1 s for all, ended within 2 s
def test_a_child_ignoring_sigterm_is_killed_after_the_grace(
    children: list[subprocess.Popen[bytes]],
) -> None:
    children.extend([_start(STUBBORN), _start(POLITE), _start(POLITE)])
    began = time.monotonic()
    assert end_process_groups(children, grace_s=1.0) == [True, True, True]
    took = time.monotonic() - began
    # one grace for all of them, not one each
    assert 1.0 <= took < 2.0, took
    assert [p.returncode for p in children] == [-signal.SIGKILL, -signal.SIGTERM, -signal.SIGTERM]


def test_a_group_that_is_not_our_child_is_still_ended(
    children: list[subprocess.Popen[bytes]],
) -> None:
    """Reconcile ends a trainer some earlier process started: only its group id is known."""
    children.append(proc := _start(POLITE))
    # reaped elsewhere (here: by a thread waiting on it), as init reaps another's orphan
    import threading

    threading.Thread(target=proc.wait, daemon=True).start()
    began = time.monotonic()
    assert end_process_group(proc.pid, grace_s=5) is True
    assert time.monotonic() - began < 1


def _queued(sessions: sessionmaker[Session], n: int) -> list[int]:
    plan = RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=1, seq_len=16),
        planner.gpu("H100-80GB"),
    )
    ids = []
    with sessions() as session:
        for _ in range(n):
            run, _ = queue_run(session=session, plan=plan, steps=2, backend="local", gate=True)
            ids.append(run.id)
    return ids


class _Settings:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_device = "cpu"
        self.max_running = 3
        self.run_retention_days = None
        self.reconcile_every_s = 30.0
        self.owner_timeout_s = 120.0


def test_supervisor_close_ends_its_trainers_together(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    sessions = store.open_store(f"sqlite:///{tmp_path}/runs.db")
    supervisor = Supervisor(sessions, _Settings(tmp_path / "runs"))
    for run_id in _queued(sessions, 3):
        with sessions() as session:
            assert supervisor._claim(session, run_id)
        children.append(proc := _start(POLITE))
        (directory := tmp_path / f"run-{run_id}").mkdir()
        logfile = open(directory / "log.txt", "ab")  # noqa: SIM115 - closed by close()
        supervisor.children[run_id] = Child(run_id, directory, proc, logfile)
        with sessions() as session:
            transitions.note_started(
                session, run_id, pid=proc.pid, log_path=logfile.name, backend="local"
            )
    began = time.monotonic()
    supervisor.close()
    assert time.monotonic() - began < 1
    assert supervisor.children == {}
    with sessions() as session:
        runs = session.query(store.Run).all()
    assert [(r.status, r.exit_code) for r in runs] == [("failed", -signal.SIGTERM)] * 3
    assert all("service shut down" in r.reason for r in runs)


def test_an_interrupted_launch_ends_its_trainer_at_once(
    tmp_path: Path, children: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``headroom launch`` Ctrl-C (``Supervisor.run_now``): the run is cancelled and its trainer,
    which exits on SIGTERM, is gone at once, not after the grace."""
    sessions = store.open_store(f"sqlite:///{tmp_path}/runs.db")
    supervisor = Supervisor(sessions, _Settings(tmp_path / "runs"))
    (run_id,) = _queued(sessions, 1)
    with sessions() as session:
        assert supervisor._claim(session, run_id)  # started already: run_now only watches it
    children.append(proc := _start(POLITE))
    logfile = open(tmp_path / "log.txt", "ab")  # noqa: SIM115 - closed when the child is reaped
    supervisor.children[run_id] = Child(run_id, tmp_path, proc, logfile)
    with sessions() as session:
        transitions.note_started(session, run_id, pid=proc.pid, log_path=logfile.name, backend="x")

    def interrupt(timeout: float | None = None) -> bool:
        raise KeyboardInterrupt  # Ctrl-C while it waits for the trainer

    monkeypatch.setattr(supervisor.stop, "wait", interrupt)
    began = time.monotonic()
    run = supervisor.run_now(run_id)
    assert time.monotonic() - began < 1
    assert run.status == "cancelled" and run.exit_code == -signal.SIGTERM, run.reason
    assert supervisor.children == {} and logfile.closed
