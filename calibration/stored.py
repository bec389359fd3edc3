"""Calibration through the store: keep a measurement with its comparison, and read back the
coefficients (and the trust in them) that ``estimate --calibrated`` uses.

Every writer of a calibration record comes through ``record_measurement``: the service's
``POST /calibrations``, a probe of the bundled trainer (``launch.recording``) and a CPU trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


Stack = tuple[str, str, str]  # (GPU, framework, activation profile)


def stacks(*, session: Session) -> list[Stack]:
    """Every (GPU, framework, profile) the store holds records of, sorted."""
    from sqlalchemy import select

    rows = session.execute(
        select(
            store.Calibration.gpu_name,
            store.Calibration.framework,
            store.Calibration.activation_profile,
        ).distinct()
    )
    return sorted((gpu, framework, profile) for gpu, framework, profile in rows)


def stack_trust(session: Session, wanted: Iterable[Stack]) -> list[dict[str, Any]]:
    """Each stack's trust as ``estimate --calibrated`` judges it (:func:`calibrated_for`): its
    recent records, whether they make it trusted, the worst under-prediction among them and
    the margin that follows; a stack whose GPU is no preset or whose profile has no calibrated
    coefficients says so instead."""
    out = []
    for gpu, framework, profile in wanted:
        entry: dict[str, Any] = {"gpu": gpu, "framework": framework, "activation_profile": profile}
        try:
            coeffs = calibrated_for(
                session=session, profile=profile, hw=planner.gpu(gpu), framework=framework
            )
        except planner.HeadroomError as exc:  # no such GPU preset, or no calibrated profile
            out.append(
                {
                    **entry,
                    "trusted": False,
                    "recent_records": 0,
                    "observed_error": None,
                    "margin_fraction": None,
                    "source": str(exc),
                }
            )
            continue
        out.append(
            {
                **entry,
                "trusted": coeffs.trusted,
                "recent_records": coeffs.recent_records,
                "observed_error": coeffs.observed_error,
                "margin_fraction": coeffs.margin_fraction,
                "source": coeffs.source,
            }
        )
    return out


def trust_line(entry: dict[str, Any]) -> str:
    """One stack's trust in words: "calibrated on 14 runs of fsdp2/torchtitan on H100-80GB,
    worst -2.1 %: trusted, margin 3 %"."""
    stack = f"{entry['framework']}/{entry['activation_profile']} on {entry['gpu']}"
    if entry["margin_fraction"] is None:
        return f"{stack}: {entry['source']}"
    worst = entry["observed_error"]
    said = f", worst {worst:+.1%}" if worst else ""
    verdict = "trusted" if entry["trusted"] else "untrusted"
    return (
        f"calibrated on {entry['recent_records']} run(s) of {stack}{said}: {verdict}, margin "
        f"{entry['margin_fraction']:.0%}"
    )
