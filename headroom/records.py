"""The command line's access to the store the service uses (``HEADROOM_DATABASE_URL``)."""

from __future__ import annotations

import uuid
from typing import Any

import planner
from headroom.autofit import ProbeOutcome, Recorder


def open_store() -> Any:
    """A sessionmaker on the configured database, migrated to the latest revision."""
    from api.db import make_engine, make_sessionmaker
    from api.migrate import upgrade
    from api.settings import Settings

    settings = Settings()
    upgrade(settings.database_url)
    return make_sessionmaker(make_engine(settings.database_url))


def probe_recorder(sessions: Any, model: planner.ModelSpec, hw: planner.Hardware) -> Recorder:
    """Store each probe that measured something as a ``probe`` calibration record."""
    from api.schemas import Measured
    from api.store import record_calibration

    def record(
        plan: planner.TrainSpec, budget: planner.Budget, outcome: ProbeOutcome
    ) -> str | None:
        if outcome.measured_peak_bytes is None:
            return None
        uid = f"probe-{uuid.uuid4().hex}"
        measured = Measured(allocated_bytes=outcome.measured_peak_bytes, phase=outcome.peak_phase)
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
                "probe",
                f"{note}; {outcome.message}",
            )
        return uid

    return record
