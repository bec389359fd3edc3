"""Measured versus predicted memory, per bucket and at the peak, for one configuration.

The estimate's allocated bytes (every bucket but ``cuda_context`` and ``allocator_overhead``)
are compared with the allocator's allocated peak; reserved bytes with allocated plus
``allocator_overhead``. A positive relative error means the estimate was high (safe side).
"""

from __future__ import annotations

from typing import Any

from headroom.planner.budget import Budget, BudgetModel

NOT_ALLOCATED = ("cuda_context", "allocator_overhead")


def _relative(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured if measured else 0.0


def compare(
    budget: Budget | BudgetModel,
    allocated_bytes: int,
    reserved_bytes: int | None = None,
    phase: str | None = None,
    buckets: dict[str, int] | None = None,
) -> dict[str, Any]:
    """How far the estimate was from a measurement, at ``phase`` (default: the predicted peak)."""
    phase = phase or budget.peak_phase
    row = budget.gpu.phases[phase].buckets
    predicted_allocated = sum(v for k, v in row.items() if k not in NOT_ALLOCATED)
    out: dict[str, Any] = {
        "phase": phase,
        "predicted_allocated_bytes": predicted_allocated,
        "measured_allocated_bytes": allocated_bytes,
        "relative_error": _relative(predicted_allocated, allocated_bytes),
        "buckets": {},
    }
    if reserved_bytes is not None:
        predicted_reserved = predicted_allocated + row["allocator_overhead"]
        out["predicted_reserved_bytes"] = predicted_reserved
        out["measured_reserved_bytes"] = reserved_bytes
        out["reserved_relative_error"] = _relative(predicted_reserved, reserved_bytes)
    for name, measured in (buckets or {}).items():
        out["buckets"][name] = {
            "predicted": row[name],
            "measured": measured,
            "relative_error": _relative(row[name], measured),
        }
    return out
