"""The store's operations: calibration records, coefficient sets and runs.

Writes are idempotent on a client-chosen ``uid``, so a client that retries after a lost
response (a restart, a timeout) never creates a duplicate and never loses a record.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from headroom import planner
from headroom.api.db import Calibration, CoefficientSet, Run
from headroom.api.schemas import CalibrationIn, Measured, RunIn
from headroom.calibration.compare import compare

#: the largest value of a BigInteger column (SQLite INTEGER, PostgreSQL bigint)
MAX_BIGINT = 2**63 - 1


def _spec_dump(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
) -> dict[str, Any]:
    return {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "hardware": hw.model_dump(mode="json"),
    }


Row = TypeVar("Row", Calibration, Run)


def _by_uid(session: Session, table: type[Row], uid: str) -> Row | None:
    return session.scalar(select(table).where(table.uid == uid))


def _insert_once(session: Session, row: Row) -> tuple[Row, bool]:
    """Commit ``row``; if its uid was committed concurrently, return that one instead."""
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        existing = _by_uid(session, type(row), row.uid)
        if existing is None:
            raise
        return existing, False
    return row, True


def _planned(
    body: CalibrationIn | RunIn,
) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware, planner.Budget]:
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(body.gpu)
    return model, train, hw, planner.estimate(model, train, hw)


def add_calibration(session: Session, body: CalibrationIn) -> tuple[Calibration, bool]:
    """Store one measurement with the estimate it is compared against; (record, created)."""
    uid = body.uid or uuid.uuid4().hex
    existing = _by_uid(session, Calibration, uid)
    if existing is not None:
        return existing, False
    model, train, hw, budget = _planned(body)
    return record_calibration(
        session, uid, model, train, hw, budget, body.measured, body.source, body.notes
    )


def record_calibration(
    session: Session,
    uid: str,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    budget: planner.Budget,
    m: Measured,
    source: str,
    notes: str = "",
) -> tuple[Calibration, bool]:
    """Store a measurement of validated specs against ``budget`` (their estimate)."""
    comparison = compare(
        budget,
        m.allocated_bytes,
        m.reserved_bytes,
        m.phase,
        dict(m.buckets) if m.buckets else None,
    )
    if comparison["predicted_allocated_bytes"] > MAX_BIGINT:
        raise planner.SpecError(
            f"model: the predicted peak ({comparison['predicted_allocated_bytes']:.3e} bytes) "
            "is beyond what a calibration record holds (2^63 - 1 bytes)",
            field="model",
        )
    record = Calibration(
        uid=uid,
        source=source,
        model_name=model.name,
        gpu_name=hw.name,
        activation_profile=train.activation_profile,
        spec=_spec_dump(model, train, hw),
        measured=m.model_dump(mode="json"),
        predicted={"budget": budget.model_dump(mode="json"), "comparison": comparison},
        measured_peak_bytes=m.allocated_bytes,
        predicted_peak_bytes=comparison["predicted_allocated_bytes"],
        relative_error=comparison["relative_error"],
        notes=notes,
    )
    return _insert_once(session, record)


def list_rows(
    session: Session, table: type[Any], limit: int, offset: int, **filters: Any
) -> tuple[list[Any], int]:
    query = select(table)
    count = select(func.count()).select_from(table)
    for column, value in filters.items():
        if value is not None:
            query = query.where(getattr(table, column) == value)
            count = count.where(getattr(table, column) == value)
    rows = list(session.scalars(query.order_by(table.id).limit(limit).offset(offset)))
    return rows, int(session.scalar(count) or 0)


def get_row(session: Session, table: type[Any], row_id: int) -> Any:
    return session.get(table, row_id)


def coefficient_sets(session: Session) -> list[dict[str, Any]]:
    """The shipped defaults (per profile) and every fitted set in the store."""
    out: list[dict[str, Any]] = []
    for profile in planner.profiles():
        c = planner.default_coefficients(profile, None)
        out.append(
            {
                "id": None,
                "profile": c.profile,
                "device": c.device,
                "calibrated": c.calibrated,
                "source": c.source,
                "values": c.model_dump(mode="json"),
                "created_at": None,
            }
        )
    for row in session.scalars(select(CoefficientSet).order_by(CoefficientSet.id)):
        out.append(
            {
                "id": row.id,
                "profile": row.profile,
                "device": row.device,
                "calibrated": True,
                "source": row.values.get("source")
                or f"fitted from {len(row.fitted_from.get('calibrations', []))} record(s)",
                "values": row.values,
                "created_at": row.created_at,
                "active": row.active,
            }
        )
    return out


def _device_is(device: str | None) -> Any:
    """The condition that a coefficient set is ``device``'s (None: the generic set)."""
    return CoefficientSet.device.is_(None) if device is None else CoefficientSet.device == device


def active_coefficients(
    session: Session, profile: str, device: str | None
) -> CoefficientSet | None:
    """The newest active fitted set of ``profile`` for ``device``, else its generic one."""
    for wanted in ([device] if device is not None else []) + [None]:
        query = select(CoefficientSet).where(
            CoefficientSet.profile == profile,
            CoefficientSet.active.is_(True),
            _device_is(wanted),
        )
        row = session.scalar(query.order_by(CoefficientSet.id.desc()).limit(1))
        if row is not None:
            return row
    return None


def save_coefficient_set(
    session: Session,
    coeffs: planner.Coefficients,
    fitted_from: dict[str, Any],
) -> CoefficientSet:
    """Store a fitted set as the active one of its profile and device (the previous active
    set stays, inactive: nothing fitted is lost)."""
    previous = select(CoefficientSet).where(
        CoefficientSet.profile == coeffs.profile,
        CoefficientSet.active.is_(True),
        _device_is(coeffs.device),
    )
    for row in session.scalars(previous):
        row.active = False
    row = CoefficientSet(
        profile=coeffs.profile,
        device=coeffs.device,
        values=coeffs.model_dump(mode="json"),
        fitted_from=fitted_from,
        active=True,
    )
    session.add(row)
    session.commit()
    return row


def recent_calibrations(
    session: Session, profile: str, gpu_name: str, limit: int
) -> list[Calibration]:
    """The newest ``limit`` calibration records of ``profile`` on ``gpu_name``, newest first."""
    query = (
        select(Calibration)
        .where(Calibration.activation_profile == profile, Calibration.gpu_name == gpu_name)
        .order_by(Calibration.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))


def add_run(session: Session, body: RunIn) -> tuple[Run, bool]:
    """Persist a run request as ``queued`` (idempotent on ``uid``); (run, created).

    With ``fit`` (the default) the ladder chooses the plan; without it the given spec must be
    predicted to fit, as the CI gate would decide. Either way nothing that is predicted to run
    out of memory is queued: the refusal is a ``SpecError`` naming the field."""
    uid = body.uid or uuid.uuid4().hex
    existing = _by_uid(session, Run, uid)
    if existing is not None:
        return existing, False
    model, train, hw, budget = _planned(body)
    from headroom.runtime.support import check_supported, runtime_precision, working_precision

    check_supported(model)
    fitted = None
    if body.fit:
        fitted = planner.fit(model, train, hw)
        if not fitted.fits or fitted.plan is None:
            raise planner.SpecError(f"train: {fitted.reason}", field="train")
        train = planner.TrainSpec.model_validate(fitted.plan)
        budget = planner.estimate(model, train, hw)
    elif not budget.fits:
        raise planner.SpecError(
            f"train: predicted out of memory on {hw.name} (peak {budget.gpu_peak_bytes} bytes "
            f"in {budget.peak_phase}, capacity {hw.memory_bytes}); set fit=true to let the "
            "ladder choose a plan that fits",
            field="train",
        )
    runtime_precision(train, working_precision(train))  # what the trainer cannot keep
    plan: dict[str, Any] = {
        **_spec_dump(model, train, hw),
        "predicted_fits": budget.fits,
        "predicted_peak_bytes": budget.gpu_peak_bytes,
        "probe": body.probe,
    }
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
        backend=body.backend,
        model_name=model.name,
        gpu_name=hw.name,
        plan=plan,
        steps=body.steps,
        reason="queued",
    )
    return _insert_once(session, run)


def as_utc(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite returns naive datetimes; every stored time is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value
