"""Every change of a run's state, each a named function and an atomic compare-and-set::

    queued ──claim──► running ──finish──► succeeded | failed
       │                 │
       └────cancel───────┴──────────────► cancelled

``queue_run`` (``launch.plan``) writes a run ``queued``. Each transition updates the row only
if it is still in the state the transition leaves, so two supervisors, a cancel and a finish
racing each other leave one winner and the others see ``False``. ``note_started``,
``note_submitted``, ``note_probing``, ``note_exit``, ``adopt`` and ``heartbeat`` change what a
run says or who watches it, not its state.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, func, select, text, update
from sqlalchemy.orm import Session, aliased

from headroom.store import Run, utcnow

#: the states a run can be cancelled from
CANCELLABLE = ("queued", "running")
#: the PostgreSQL advisory lock that claims under ``max_running`` take in turn ("headroom")
CLAIM_LOCK = int.from_bytes(b"headroom", "big") >> 1


def _changed(
    session: Session, run_id: int, state: str, /, *also: ColumnElement[bool], **values: Any
) -> bool:
    """Update run ``run_id`` with ``values`` if it is in ``state`` (and ``also`` holds);
    whether it was."""
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == state, *also)
        .values(**values, updated_at=utcnow())
    )
    session.commit()
    return bool(result.rowcount)  # type: ignore[attr-defined]


def next_queued(session: Session) -> int | None:
    """The oldest queued run's id (None: nothing is queued)."""
    return session.scalar(select(Run.id).where(Run.status == "queued").order_by(Run.id).limit(1))


def claim(
    session: Session, run_id: int, *, owner: str, device: str, max_running: int | None = None
) -> bool:
    """queued → running, owned by ``owner`` on ``device``; False if another claimed it first,
    or if ``max_running`` runs are running already (every supervisor on the database counted:
    on PostgreSQL the claims take one transaction-scoped advisory lock in turn, so two replicas
    cannot both see the last free place; SQLite has one writer at a time)."""
    now = utcnow()
    values = {
        "status": "running",
        "owner": owner,
        "device": device,
        "started_at": now,
        "owner_seen_at": now,
    }
    if max_running is None:
        claimed = _changed(session, run_id, "queued", **values, reason="starting")
    else:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CLAIM_LOCK})
        other = aliased(Run)
        running = (
            select(func.count())
            .select_from(other)
            .where(other.status == "running")
            .scalar_subquery()
        )
        claimed = _changed(
            session, run_id, "queued", running < max_running, **values, reason="starting"
        )
    if claimed:
        # stamped again once the claim has won: ``now`` was taken before the claim's update,
        # and a place another replica's ``finish`` freed in between would make this run seem
        # to start before that one ended (the finish stamps its time before it commits)
        _changed(session, run_id, "running", Run.owner == owner, started_at=utcnow())
    return claimed


def note_probing(session: Session, run_id: int, *, pid: int, log_path: str) -> bool:
    """A running run is being probed before it starts, by its probe process ``pid`` (whose
    group a cancel ends); False if it was cancelled meanwhile."""
    return _changed(
        session, run_id, "running", pid=pid, log_path=log_path, reason=f"probing: pid {pid}"
    )


def note_started(session: Session, run_id: int, *, pid: int, log_path: str, backend: str) -> bool:
    """A running run's trainer started as ``pid``; False if it was cancelled meanwhile."""
    return _changed(
        session,
        run_id,
        "running",
        pid=pid,
        log_path=log_path,
        reason=f"running: pid {pid} ({backend})",
    )


def note_submitted(session: Session, run_id: int, *, job_id: str, log_path: str) -> bool:
    """A running run's trainer was submitted as Slurm job ``job_id``; False if it was cancelled
    meanwhile."""
    return _changed(
        session,
        run_id,
        "running",
        job_id=job_id,
        log_path=log_path,
        reason=f"running: slurm job {job_id}",
    )


def adopt(session: Session, run_id: int, *, owner: str | None, by: str) -> bool:
    """A running run whose supervisor (``owner``) is gone is watched by ``by`` from now on (a
    Slurm job outlives the service that submitted it); False if another took it first."""
    was = Run.owner.is_(None) if owner is None else Run.owner == owner
    return _changed(session, run_id, "running", was, owner=by, owner_seen_at=utcnow())


def heartbeat(session: Session, owner: str) -> int:
    """``owner`` still watches its running runs (``owner_seen_at``); how many it has."""
    result = session.execute(
        update(Run)
        .where(Run.owner == owner, Run.status == "running")
        .values(owner_seen_at=utcnow())
    )
    session.commit()
    return int(result.rowcount)  # type: ignore[attr-defined]


def finish(
    session: Session, run_id: int, *, status: str, reason: str, exit_code: int | None
) -> bool:
    """running → ``status`` (succeeded or failed); False if it was no longer running."""
    assert status in ("succeeded", "failed"), status
    return _changed(
        session,
        run_id,
        "running",
        status=status,
        reason=reason,
        exit_code=exit_code,
        finished_at=utcnow(),
    )


def note_exit(session: Session, run_id: int, *, exit_code: int | None) -> None:
    """A cancelled run keeps how its trainer ended (its state stays cancelled)."""
    _changed(session, run_id, "cancelled", exit_code=exit_code)


def cancel(session: Session, run: Run) -> bool:
    """queued or running → cancelled; False if it had already ended (or just did)."""
    if run.status not in CANCELLABLE:
        return False
    cancelled = _changed(
        session,
        run.id,
        run.status,
        status="cancelled",
        reason="cancelled by request",
        finished_at=utcnow(),
    )
    session.refresh(run)
    return cancelled


def record_probes(session: Session, run: Run, plan: dict[str, Any]) -> bool:
    """Keep the probes made of a running run, and the plan they confirmed, as the run's plan;
    False if it is no longer running (a cancelled run keeps nothing of its probes)."""
    recorded = _changed(session, run.id, "running", plan=plan)
    session.refresh(run)
    return recorded
