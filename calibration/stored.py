"""Calibration through the store: keep a measurement with its comparison, and read back the
coefficients (and the trust in them) that ``estimate --calibrated`` uses.

Every writer of a calibration record comes through ``record_measurement``: the service's
``POST /calibrations``, a probe of the bundled trainer (``launch.recording``) and a CPU trace.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from headroom import planner, store
from headroom.calibration.comparison import compare, measured_stage
from headroom.calibration.trust import RECENT, assess_records
from headroom.planner.measurement import Measurement


def record_measurement(
    *,
    session: Session,
    uid: str,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    measured: Measurement,
    source: str,
    notes: str = "",
    budget: planner.Budget | planner.BudgetModel | None = None,
) -> tuple[store.Calibration, bool]:
    """Store ``measured`` with the estimate of the specs (``budget``, estimated here if not
    given) and how they compare; (record, created)."""
    budget = budget if budget is not None else planner.estimate(model, train, hw)
    comparison = compare(budget, measured, measured_stage(measured, model, train, hw))
    return store.add_calibration(
        session=session,
        uid=uid,
        model=model,
        train=train,
        hw=hw,
        budget=budget,
        measured=measured,
        comparison=comparison,
        source=source,
        notes=notes,
    )


def calibrated_for(
    *, session: Session, profile: str, hw: planner.Hardware, framework: str = "none"
) -> planner.Coefficients:
    """The fitted set ``estimate --calibrated`` uses, judged by the trust rule.

    The store's active set for ``hw`` wins, then its generic one, then the shipped set
    (``NotCalibrated`` if the profile has none); the newest records of the profile under the
    same ``framework`` on ``hw`` then set its trust and margin (``calibration.trust``): the
    coefficients are the model code's, the evidence is the (implementation, framework)
    pair's."""
    row = store.active_coefficients(session=session, profile=profile, device=hw.name)
    if row is not None:
        coeffs = planner.Coefficients.model_validate(row.values)
    else:
        coeffs = planner.calibrated_coefficients(profile, hw.name)
    recent = [
        (r.spec, r.measured)
        for r in store.recent_calibrations(
            session=session, profile=profile, gpu_name=hw.name, limit=RECENT, framework=framework
        )
    ]
    return assess_records(coeffs, recent)
