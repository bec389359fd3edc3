"""Calibration records and coefficient sets: what the store keeps of measurements and fits.

A record keeps the specs, the estimate, the measurement and their comparison (computed by
``headroom.calibration``); the store only checks that the numbers fit its columns.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from headroom import planner
from headroom.planner.measurement import Measurement
from headroom.store.rows import by_uid, insert_once
from headroom.store.tables import Calibration, CoefficientSet

#: the largest value of a BigInteger column (SQLite INTEGER, PostgreSQL bigint)
MAX_BIGINT = 2**63 - 1


def spec_dump(
    *, model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
) -> dict[str, Any]:
    """The specs as a record or a run keeps them (JSON)."""
    return {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "hardware": hw.model_dump(mode="json"),
    }


def calibration_by_uid(*, session: Session, uid: str) -> Calibration | None:
    return by_uid(session=session, table=Calibration, uid=uid)


def add_calibration(
    *,
    session: Session,
    uid: str,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    budget: planner.Budget | planner.BudgetModel,
    measured: Measurement,
    comparison: dict[str, Any],
    source: str,
    notes: str = "",
) -> tuple[Calibration, bool]:
    """Store a measurement of validated specs with ``budget`` (their estimate) and how the
    two compare; (record, created): a uid stored concurrently returns that record."""
    if comparison["predicted_bytes"] > MAX_BIGINT:
        raise planner.SpecError(
            f"model: the predicted peak ({comparison['predicted_bytes']:.3e} bytes) "
            "is beyond what a calibration record holds (2^63 - 1 bytes)",
            field="model",
        )
    record = Calibration(
        uid=uid,
        source=source,
        model_name=model.name,
        gpu_name=hw.name,
        activation_profile=train.activation_profile,
        framework=train.framework,
        spec=spec_dump(model=model, train=train, hw=hw),
        measured=measured.model_dump(mode="json"),
        predicted={"budget": budget.model_dump(mode="json"), "comparison": comparison},
        measured_peak_bytes=measured.figure_bytes,
        predicted_peak_bytes=comparison["predicted_bytes"],
        relative_error=comparison["relative_error"],
        notes=notes,
    )
    return insert_once(session=session, row=record)


def all_calibrations(*, session: Session) -> list[Calibration]:
    """Every calibration record, oldest first."""
    return list(session.scalars(select(Calibration).order_by(Calibration.id)))


def recent_calibrations(
    *, session: Session, profile: str, gpu_name: str, limit: int, framework: str = "none"
) -> list[Calibration]:
    """The newest ``limit`` calibration records of ``profile`` under ``framework`` on
    ``gpu_name``, newest first."""
    query = (
        select(Calibration)
        .where(
            Calibration.activation_profile == profile,
            Calibration.framework == framework,
            Calibration.gpu_name == gpu_name,
        )
        .order_by(Calibration.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))


def coefficient_sets(*, session: Session) -> list[dict[str, Any]]:
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
    *, session: Session, profile: str, device: str | None
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
    *, session: Session, coeffs: planner.Coefficients, fitted_from: dict[str, Any]
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
