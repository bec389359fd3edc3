"""Runs as the store keeps them: a new run is written ``queued`` with its plan.

Every later change of a run's state is a named transition of ``headroom.launch.transitions``.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.orm import Session

from headroom import planner
from headroom.store.calibrations import spec_dump
from headroom.store.rows import by_uid, insert_once
from headroom.store.tables import Run

#: a run's uid names its directory under RUN_DIR: a plain name, so never ``.``, ``..``, a
#: hidden name or a path (no separator); the API's ``RunIn.uid`` has the same pattern
RUN_UID_PATTERN = r"^[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,63}$"
RUN_UID_RULE = (
    "1 to 64 of the characters A-Z a-z 0-9 . _ : -, not starting with '.' "
    f"(pattern {RUN_UID_PATTERN})"
)


def check_run_uid(uid: str) -> str:
    """``uid`` if it may name a run (its directory); else a ``SpecError`` naming ``uid``."""
    if not re.fullmatch(RUN_UID_PATTERN, uid):
        raise planner.SpecError(
            f"uid: {uid[:64]!r} is not allowed; allowed: {RUN_UID_RULE}", field="uid"
        )
    return uid


def run_by_uid(*, session: Session, uid: str) -> Run | None:
    return by_uid(session=session, table=Run, uid=uid)


def add_run(
    *,
    session: Session,
    uid: str,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    predicted_fits: bool,
    predicted_peak_bytes: int,
    steps: int,
    backend: str,
    probe: bool,
    fitted: planner.FitResult | None = None,
    slurm: dict[str, Any] | None = None,
    request: dict[str, Any] | None = None,
) -> tuple[Run, bool]:
    """Store a planned run as ``queued``: the specs it trains, what their estimate predicted
    and, where the ladder chose the plan, what it weighed, and the ``request`` it was queued
    from (JSON: what a retry under its uid is compared with); (run, created): a uid stored
    concurrently returns that run. A uid that could not name a run directory is a
    ``SpecError`` (``check_run_uid``)."""
    check_run_uid(uid)
    plan: dict[str, Any] = {
        **spec_dump(model=model, train=train, hw=hw),
        "predicted_fits": predicted_fits,
        "predicted_peak_bytes": predicted_peak_bytes,
        "probe": probe,
    }
    if slurm is not None:  # a Slurm job's own allocation (``launch.slurm.SlurmOverrides``)
        plan["slurm"] = slurm
    if fitted is not None:
        plan["fit"] = {
            "predicted_step_seconds": fitted.predicted_step_seconds,
            "candidates_considered": fitted.candidates_considered,
            "candidates_fitting": fitted.candidates_fitting,
            "reason": fitted.reason,
        }
    run = Run(
        uid=uid,
        status="queued",
        backend=backend,
        model_name=model.name,
        gpu_name=hw.name,
        plan=plan,
        request=request,
        steps=steps,
        reason="queued",
    )
    return insert_once(session=session, row=run)
