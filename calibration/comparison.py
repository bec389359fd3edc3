"""Measured versus predicted memory, per bucket and at the peak, for one configuration.

The estimate's allocated bytes (every bucket but ``cuda_context`` and ``allocator_overhead``)
are compared with the allocator's allocated peak; reserved bytes with allocated plus
``allocator_overhead``. A positive relative error means the estimate was high (safe side).
"""

from __future__ import annotations

from typing import Any

from headroom.planner.budget import Budget, BudgetModel

NOT_ALLOCATED = ("cuda_context", "allocator_overhead")
#: the buckets a CPU trace of framework code is compared in ("transient" is TRANSIENT_BUCKETS)
COMPARED = ("params", "grads", "optimizer_states", "transient")
TRANSIENT_BUCKETS = ("activations", "logits", "moe_dispatch")


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


def compare_trace(budget: Budget, measured: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction next to a trace, per bucket and at the peak.

    Predicted bytes are the allocated buckets of the budget's peak phase (no CUDA context or
    allocator overhead: a CPU trace has neither); a sharded run's gathered parameters
    (``transfer_buffers``) count with ``params``, as a framework trace's unsharded parameters
    and all-gather outputs do. ``error`` is (predicted - measured) over measured: positive is
    the safe side."""
    row = budget.gpu.phases[budget.peak_phase].buckets
    predicted = {
        "params": row["params"] + row["master_params"] + row["transfer_buffers"],
        "grads": row["grads"],
        "optimizer_states": row["optimizer_states"],
        "transient": sum(row[b] for b in TRANSIENT_BUCKETS),
    }
    predicted["total"] = sum(predicted[b] for b in COMPARED)
    peak = measured["peak"]

    def err(p: int, m: int) -> float | None:
        return (p - m) / m if m else None

    return {
        "phase": budget.peak_phase,
        "predicted": predicted,
        "measured": {k: peak[k] for k in (*COMPARED, "total")},
        "error": {k: err(predicted[k], peak[k]) for k in (*COMPARED, "total")},
        "predicted_peak_bytes": predicted["total"],
        "measured_peak_bytes": peak["total"],
        "transient_buckets": list(TRANSIENT_BUCKETS),
    }
