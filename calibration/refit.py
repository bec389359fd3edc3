"""``headroom calibrate fit``: refit coefficient sets from the committed traces and the store.

Activation terms are fitted (``calibration.regression``) per profile from every trace that says what
was live at the end of a steady-state forward: the committed ones
(``calibration/data/<profile>-traces.json``, those not held out) and the store's ``trace``
records of that profile (``headroom calibrate trace --record``). They give a generic set
(device None): a trace measures allocated bytes, which do not depend on the GPU.

GPU records that carry reserved bytes (runtime runs and probes) add, per GPU, the allocator's
overhead: the median of (reserved - allocated) / allocated over that GPU's records; those that
carry a ``cuda_context`` bucket (what the device used beyond the allocator's reservation) add
its context: the largest measured, since every run pays it whole. A GPU with such records gets
its own set: the generic activation terms with its fitted overhead and context.
"""

from __future__ import annotations

import statistics
from typing import Any

from headroom import planner
from headroom.calibration.regression import FITTED, fit_coefficients, peak_errors
from headroom.calibration.trace_records import TraceRecord, fitted_records, load_traces

#: fewer traces than this fit nothing
MIN_TRACES = 3


def committed_records(profile: str) -> list[TraceRecord]:
    """The committed traces of ``profile`` the shipped set is fitted from (none if no file)."""
    return fitted_records(load_traces(profile))


def stored_trace_records(rows: list[Any], profile: str) -> list[TraceRecord]:
    """Calibration rows (``headroom.store.Calibration``) of ``profile`` that a fit can use."""
    out = []
    for row in rows:
        transient = (row.measured or {}).get("forward_transient_bytes")
        if row.source != "trace" or row.activation_profile != profile or transient is None:
            continue
        out.append(
            TraceRecord(
                uid=row.uid,
                model=planner.ModelSpec.model_validate(row.spec["model"]),
                train=planner.TrainSpec.model_validate(row.spec["train"]),
                forward_transient_bytes=int(transient),
                peak_bytes=int(row.measured_peak_bytes),
            )
        )
    return out


def allocator_overheads(rows: list[Any]) -> dict[str, tuple[float, int]]:
    """GPU name → (median (reserved - allocated) / allocated, records) over GPU records."""
    ratios: dict[str, list[float]] = {}
    for row in rows:
        measured = row.measured or {}
        reserved, allocated = measured.get("reserved_bytes"), measured.get("allocated_bytes")
        if row.source == "trace" or not reserved or not allocated or reserved < allocated:
            continue
        ratios.setdefault(row.gpu_name, []).append((reserved - allocated) / allocated)
    return {gpu: (statistics.median(r), len(r)) for gpu, r in sorted(ratios.items())}


def contexts(rows: list[Any]) -> dict[str, tuple[int, int]]:
    """GPU name → (largest measured ``cuda_context`` bytes, records) over GPU records."""
    sizes: dict[str, list[int]] = {}
    for row in rows:
        context = ((row.measured or {}).get("buckets") or {}).get("cuda_context")
        if row.source == "trace" or not context:
            continue
        sizes.setdefault(row.gpu_name, []).append(int(context))
    return {gpu: (max(c), len(c)) for gpu, c in sorted(sizes.items())}


def _errors(records: list[TraceRecord], coeffs: planner.Coefficients) -> dict[str, float]:
    errors = [abs(e) for e in peak_errors(records, coeffs)]
    return {"max": max(errors), "median": statistics.median(errors)}


def refit_profile(
    rows: list[Any], profile: str, committed: bool = True
) -> tuple[list[tuple[planner.Coefficients, dict[str, Any]]], dict[str, Any]]:
    """The sets to store for ``profile`` with what each was fitted from, and a summary.

    Raises ``SpecError`` naming ``profile`` when fewer than :data:`MIN_TRACES` traces exist."""
    planner.default_coefficients(profile)  # an unknown profile is refused, naming the field
    base = committed_records(profile) if committed else []
    stored = stored_trace_records(rows, profile)
    records = base + stored
    if len(records) < MIN_TRACES:
        raise planner.SpecError(
            f"profile: {profile!r} has {len(records)} trace(s) to fit from (committed "
            f"{len(base)}, stored {len(stored)}); at least {MIN_TRACES} are needed: record "
            f"some with headroom calibrate trace MODEL --impl ... --record",
            field="profile",
        )
    source = (
        f"headroom calibrate fit: activation terms from {len(base)} committed and "
        f"{len(stored)} stored trace(s)"
    )
    generic = fit_coefficients(records, profile, source=source)
    fitted_from: dict[str, Any] = {
        "committed": len(base),
        "calibrations": [r.uid for r in stored],
    }
    sets = [(generic, fitted_from)]
    overheads, context = allocator_overheads(rows), contexts(rows)
    for gpu in sorted(overheads.keys() | context.keys()):
        update: dict[str, Any] = {"device": gpu}
        notes, counts = [], {}
        if gpu in overheads:
            fraction, n = overheads[gpu]
            update["allocator_overhead_fraction"] = min(fraction, 0.99)
            notes.append(f"allocator overhead from {n} {gpu} record(s)")
            counts["allocator_records"] = n
        if gpu in context:
            size, n = context[gpu]
            update["cuda_context_bytes"] = size
            notes.append(f"CUDA context from {n} {gpu} record(s)")
            counts["context_records"] = n
        update["source"] = "; ".join([source, *notes])
        sets.append((generic.model_copy(update=update), {**fitted_from, **counts}))
    previous = planner.default_coefficients(profile)
    summary = {
        "profile": profile,
        "traces": {"committed": len(base), "stored": len(stored)},
        "values": {name: getattr(generic, name) for name in FITTED},
        "peak_error": _errors(records, generic),
        "shipped_peak_error": _errors(records, previous),
        "allocator_overhead": {
            gpu: {"fraction": f, "records": n} for gpu, (f, n) in overheads.items()
        },
        "cuda_context": {gpu: {"bytes": b, "records": n} for gpu, (b, n) in context.items()},
    }
    return sets, summary
