"""The command line's access to the store the service uses (``HEADROOM_DATABASE_URL``)."""

from __future__ import annotations

import uuid
from typing import Any

from headroom import planner
from headroom.autofit import ProbeOutcome, Recorder


def open_store() -> Any:
    """A sessionmaker on the configured database, migrated to the latest revision."""
    from headroom.api.db import make_engine, make_sessionmaker
    from headroom.api.migrate import upgrade
    from headroom.api.settings import Settings

    settings = Settings()
    upgrade(settings.database_url)
    return make_sessionmaker(make_engine(settings.database_url))


def calibrated_for(profile: str, hw: planner.Hardware) -> planner.Coefficients:
    """The fitted set ``estimate --calibrated`` uses, judged by the trust rule.

    The store's active set for ``hw`` wins, then its generic one, then the shipped set
    (``NotCalibrated`` if the profile has none); the newest records of the profile on ``hw``
    then set its trust and margin (``calibration.trust``)."""
    from headroom.api.store import active_coefficients, recent_calibrations
    from headroom.calibration.trust import RECENT, assess_records

    with open_store()() as session:
        row = active_coefficients(session, profile, hw.name)
        if row is not None:
            coeffs = planner.Coefficients.model_validate(row.values)
        else:
            coeffs = planner.calibrated_coefficients(profile, hw.name)
        recent = [
            (r.spec, r.measured) for r in recent_calibrations(session, profile, hw.name, RECENT)
        ]
    return assess_records(coeffs, recent)


def probe_recorder(
    sessions: Any, model: planner.ModelSpec, hw: planner.Hardware, source: str = "probe"
) -> Recorder:
    """Store each probe that measured something as a calibration record of ``source``."""
    from headroom.api.schemas import Measured
    from headroom.api.store import record_calibration

    def record(
        plan: planner.TrainSpec, budget: planner.Budget, outcome: ProbeOutcome
    ) -> str | None:
        if outcome.measured_peak_bytes is None:
            return None
        uid = f"{source}-{uuid.uuid4().hex}"
        reserved = outcome.reserved_peak_bytes
        transient = outcome.attribution.get("forward_transient_bytes")
        context = outcome.attribution.get("context_bytes")
        measured = Measured(
            allocated_bytes=outcome.measured_peak_bytes,
            reserved_bytes=reserved
            if reserved and reserved >= outcome.measured_peak_bytes
            else None,
            phase=outcome.peak_phase,
            forward_transient_bytes=transient if transient is not None and transient >= 0 else None,
            # what the device used beyond the allocator's reservation: CUDA context, cuBLAS
            # and NCCL workspaces outside the allocator
            buckets={"cuda_context": context} if context else None,
        )
        note = (
            "out of memory: the measured bytes are a lower bound"
            if outcome.oom
            else "ran into step 2"
        )
        with sessions() as session:
            record_calibration(
                session,
                uid,
                model,
                plan,
                hw,
                budget,
                measured,
                source,
                f"{note}; {outcome.message}",
            )
        return uid

    return record
