"""How a run ended is never lost between its trainer and the store.

A supervisor keeps each trainer until the store has its ending, and keeps the ending in the
run's directory first (``ending.json``): a supervisor that stops before the database took the
ending leaves it there for the next one. A run this supervisor claimed and then lost (the
database failed while it started) is ended by its own reconciliation, which used to skip every
run of a live service.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.launch import RunPlan, Supervisor, queue_run, transitions
from headroom.launch.rundirs import ENDING_FILE, Ending, read_ending, save_ending
from headroom.launch.supervisor import this_process


class _Settings:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_device = "cpu"
        self.max_running = 1
        self.run_retention_days = None


def _running(sessions: sessionmaker[Session], owner: str, uid: str) -> int:
    """A run claimed (``running``) by ``owner``, as a supervisor leaves it."""
    plan = RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=1, seq_len=16),
        planner.gpu("H100-80GB"),
    )
    with sessions() as session:
        run, _ = queue_run(session=session, plan=plan, steps=2, backend="local", gate=True, uid=uid)
        assert transitions.claim(session, run.id, owner=owner, device="cpu")
        return run.id


def _gone_owner() -> str:
    """The owner tag of a process that has exited."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return f"{this_process().split(':')[0]}:{int(gone.stdout)}:1"


def test_an_ending_kept_in_the_run_directory_is_what_reconcile_records(tmp_path: Path) -> None:
    sessions = store.open_store(f"sqlite:///{tmp_path}/runs.db")
    settings = _Settings(tmp_path / "runs")
    run_id = _running(sessions, _gone_owner(), "killed-run")
    directory = tmp_path / "runs" / "killed-run"
    directory.mkdir(parents=True)
    # what its supervisor saw, and kept, while the database was away; its report shows steps
    save_ending(directory, Ending("failed", "killed by SIGKILL", -9))
    (directory / "report.json").write_text(json.dumps({"losses": [1.0]}))
    assert stat.S_IMODE((directory / ENDING_FILE).stat().st_mode) == 0o600
    assert Supervisor(sessions, settings).reconcile() == 1
    with sessions() as session:
        run = session.get(store.Run, run_id)
        assert run is not None
        assert (run.status, run.reason, run.exit_code) == ("failed", "killed by SIGKILL", -9)


def test_an_unreadable_ending_file_falls_back_to_the_report(tmp_path: Path) -> None:
    directory = tmp_path / "runs" / "r"
    directory.mkdir(parents=True)
    for text in ("", "{", '{"status": "running", "reason": "x", "exit_code": 0}', "[1]"):
        (directory / ENDING_FILE).write_text(text)
        assert read_ending(directory) is None, text


def test_a_run_this_supervisor_claimed_and_lost_is_ended(tmp_path: Path) -> None:
    sessions = store.open_store(f"sqlite:///{tmp_path}/runs.db")
    supervisor = Supervisor(sessions, _Settings(tmp_path / "runs"))
    lost = _running(sessions, supervisor.owner, "lost-run")
    # another supervisor in this same process (alive) keeps its own runs
    other = Supervisor(sessions, _Settings(tmp_path / "runs"))
    kept = _running(sessions, other.owner, "other-run")
    assert supervisor.reconcile() == 1
    with sessions() as session:
        run = session.get(store.Run, lost)
        assert run is not None and run.status == "failed", run.reason
        assert run.reason == "could not start: the database failed while it started"
        other_run = session.get(store.Run, kept)
        assert other_run is not None and other_run.status == "running"
