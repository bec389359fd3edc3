"""Run-state transitions: each is a compare-and-set, so of two racing changes one wins."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.launch import RunPlan, queue_run, transitions


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    return store.open_store(f"sqlite:///{tmp_path}/runs.db")


def _queued(session: Session) -> store.Run:
    plan = RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=1, seq_len=16),
        planner.gpu("H100-80GB"),
    )
    run, created = queue_run(session=session, plan=plan, steps=2, backend="local", gate=True)
    assert created and run.status == "queued" and run.reason == "queued"
    assert run.plan["predicted_fits"] is True and run.plan["probe"] is False
    return run


def test_a_run_is_claimed_once_and_finishes_once(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        run = _queued(session)
        assert transitions.next_queued(session) == run.id
        assert transitions.claim(session, run.id, owner="a", device="cpu")
        assert not transitions.claim(session, run.id, owner="b", device="cpu")
        assert transitions.next_queued(session) is None
        assert transitions.note_started(session, run.id, pid=1, log_path="x", backend="local")
        assert transitions.finish(session, run.id, status="succeeded", reason="done", exit_code=0)
        assert not transitions.finish(session, run.id, status="failed", reason="late", exit_code=1)
        assert not transitions.cancel(session, run)
        session.refresh(run)
        assert (run.status, run.owner, run.reason, run.exit_code) == ("succeeded", "a", "done", 0)
        assert run.finished_at is not None


def test_a_cancelled_run_is_neither_claimed_nor_finished(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        run = _queued(session)
        assert transitions.cancel(session, run)
        assert run.status == "cancelled" and run.reason == "cancelled by request"
        assert not transitions.claim(session, run.id, owner="a", device="cpu")
        assert not transitions.finish(session, run.id, status="failed", reason="x", exit_code=1)
        assert not transitions.cancel(session, run)


def test_queueing_the_same_uid_twice_keeps_one_run(sessions: sessionmaker[Session]) -> None:
    plan = RunPlan.estimated(
        planner.load_model("tiny-dense"), planner.TrainSpec(), planner.gpu("H100-80GB")
    )
    with sessions() as session:
        first, created = queue_run(
            session=session, plan=plan, steps=1, backend="local", gate=True, uid="same"
        )
        again, created_again = queue_run(
            session=session, plan=plan, steps=1, backend="local", gate=True, uid="same"
        )
    assert created and not created_again and again.id == first.id


def test_a_claim_under_max_running_waits_for_a_free_place(
    sessions: sessionmaker[Session],
) -> None:
    """``max_running`` counts every running run on the database, whoever supervises it."""
    with sessions() as session:
        first, second = _queued(session), _queued(session)
        assert transitions.claim(session, first.id, owner="a", device="cpu", max_running=1)
        assert not transitions.claim(session, second.id, owner="b", device="cpu", max_running=1)
        session.refresh(second)
        assert second.status == "queued" and second.owner is None
        assert transitions.finish(session, first.id, status="succeeded", reason="", exit_code=0)
        assert transitions.claim(session, second.id, owner="b", device="cpu", max_running=1)


def test_a_supervisor_starts_nothing_while_other_supervisors_fill_max_running(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Another replica's run takes the one place: a tick claims nothing and returns (it does
    not spin on the queued run it may not start)."""
    from headroom.launch import LaunchSettings, Supervisor

    with sessions() as session:
        theirs, ours = _queued(session), _queued(session)
        assert transitions.claim(session, theirs.id, owner="elsewhere", device="cpu")
    settings = LaunchSettings(run_dir=tmp_path / "runs", run_device="cpu", max_running=1)
    supervisor = Supervisor(sessions, settings)
    supervisor.tick()
    assert supervisor.children == {}
    with sessions() as session:
        assert session.get(store.Run, ours.id).status == "queued"  # type: ignore[union-attr]
