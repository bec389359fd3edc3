"""Probe recording: each probe of the bundled trainer that measured something becomes a
calibration record (``calibration.stored.record_measurement``)."""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session, sessionmaker

from headroom import planner
from headroom.calibration.stored import record_measurement
from headroom.launch.probing import ProbeOutcome, Recorder
from headroom.planner.measurement import Measurement


def measurement_of(outcome: ProbeOutcome) -> Measurement | None:
    """What a probe measured, as a calibration record keeps it (None: nothing)."""
    if outcome.measured_peak_bytes is None:
        return None
    reserved = outcome.reserved_peak_bytes
    transient = outcome.attribution.get("forward_transient_bytes")
    context = outcome.attribution.get("context_bytes")
    return Measurement(
        allocated_bytes=outcome.measured_peak_bytes,
        reserved_bytes=reserved if reserved and reserved >= outcome.measured_peak_bytes else None,
        phase=outcome.peak_phase,
        forward_transient_bytes=transient if transient is not None and transient >= 0 else None,
        # what the device used beyond the allocator's reservation: CUDA context, cuBLAS and
        # NCCL workspaces outside the allocator
        buckets={"cuda_context": context} if context else None,
    )


def probe_recorder(
    sessions: sessionmaker[Session],
    model: planner.ModelSpec,
    hw: planner.Hardware,
    source: str = "probe",
) -> Recorder:
    """Store each probe that measured something as a calibration record of ``source``."""

    def record(
        plan: planner.TrainSpec,
        budget: planner.Budget | planner.BudgetModel,
        outcome: ProbeOutcome,
    ) -> str | None:
        measured = measurement_of(outcome)
        if measured is None:
            return None
        uid = f"{source}-{uuid.uuid4().hex}"
        note = (
            "out of memory: the measured bytes are a lower bound"
            if outcome.oom
            else "ran into step 2"
        )
        with sessions() as session:
            record_measurement(
                session=session,
                uid=uid,
                model=model,
                train=plan,
                hw=hw,
                measured=measured,
                source=source,
                notes=f"{note}; {outcome.message}",
                budget=budget,
            )
        return uid

    return record
