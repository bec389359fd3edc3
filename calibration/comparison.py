"""Measured versus predicted memory, per bucket and at the peak, for one configuration.

The estimate's allocated bytes (every bucket but ``cuda_context`` and ``allocator_overhead``)
are compared with the allocator's allocated peak; reserved bytes with allocated plus
``allocator_overhead``; nvidia-smi's total with every bucket. A positive relative error means
the estimate was high (safe side).
"""

from __future__ import annotations

from typing import Any

from headroom.planner.budget import Budget, BudgetModel
from headroom.planner.coefficients import Coefficients
from headroom.planner.estimator import StagePeak, stage_peaks
from headroom.planner.hardware import Hardware
from headroom.planner.measurement import Measurement
from headroom.planner.model import ModelSpec
from headroom.planner.train import TrainSpec

NOT_ALLOCATED = ("cuda_context", "allocator_overhead")
#: the buckets a CPU trace of framework code is compared in ("transient" is TRANSIENT_BUCKETS)
COMPARED = ("params", "grads", "optimizer_states", "transient")
TRANSIENT_BUCKETS = ("activations", "logits", "moe_dispatch")


def _relative(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured if measured else 0.0


def compare(
    budget: Budget | BudgetModel, measured: Measurement, stage: StagePeak | None = None
) -> dict[str, Any]:
    """How far the estimate was from a measurement, at its phase (default: the predicted peak),
    like with like: an allocated peak with the phase's allocated buckets, a reserved peak with
    those plus ``allocator_overhead``, nvidia-smi's total with the whole row. ``figure``,
    ``predicted_bytes``, ``measured_bytes`` and ``relative_error`` are the figure compared
    (:attr:`Measurement.figure`); each other figure measured is compared too. ``stage``: the
    pipeline stage whose rank measured it (:func:`measured_stage`), whose peak is compared
    instead of the heaviest's."""
    phase = measured.phase or (stage.phase if stage is not None else budget.peak_phase)
    row = budget.gpu.phases[phase].buckets
    predicted_allocated = sum(v for k, v in row.items() if k not in NOT_ALLOCATED)
    predicted = {
        "max_allocated": predicted_allocated,
        "max_reserved": predicted_allocated + row["allocator_overhead"],
        "nvidia_smi_total": sum(row.values()),
    }
    if stage is not None:
        predicted_allocated = stage.allocated_bytes
        predicted = {
            "max_allocated": stage.allocated_bytes,
            "max_reserved": stage.reserved_bytes,
            "nvidia_smi_total": stage.peak_bytes,
        }
    figure = measured.figure
    out: dict[str, Any] = {
        "phase": phase,
        **({"stage": stage.stage} if stage is not None else {}),
        "figure": figure,
        "predicted_bytes": predicted[figure],
        "measured_bytes": measured.figure_bytes,
        "relative_error": _relative(predicted[figure], measured.figure_bytes),
        "buckets": {},
    }
    if measured.allocated_bytes is not None:
        out["predicted_allocated_bytes"] = predicted_allocated
        out["measured_allocated_bytes"] = measured.allocated_bytes
    if measured.reserved_bytes is not None:
        out["predicted_reserved_bytes"] = predicted["max_reserved"]
        out["measured_reserved_bytes"] = measured.reserved_bytes
        out["reserved_relative_error"] = _relative(
            predicted["max_reserved"], measured.reserved_bytes
        )
    if measured.nvidia_smi_bytes is not None:
        out["predicted_nvidia_smi_bytes"] = predicted["nvidia_smi_total"]
        out["measured_nvidia_smi_bytes"] = measured.nvidia_smi_bytes
    for name, value in (measured.buckets or {}).items():
        out["buckets"][name] = {
            "predicted": row[name],
            "measured": value,
            "relative_error": _relative(row[name], value),
        }
    return out


def measured_stage(
    measured: Measurement,
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    coefficients: Coefficients | None = None,
) -> StagePeak | None:
    """The pipeline stage a measurement names (``stage``: first or last) as the estimate prices
    it; None where it names none or there is no pipeline (the heaviest stage is compared)."""
    return named_stage(measured.stage, model, train, hardware, coefficients)


def named_stage(
    where: str | None,
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    coefficients: Coefficients | None = None,
) -> StagePeak | None:
    """The stage ``where`` names (``first``, else the last) as the estimate prices it; None
    where it names none or there is no pipeline. Megatron-LM logs from the last rank, a run
    that says which rank logged is compared with that rank's stage."""
    if where is None or train.parallel.pp == 1:
        return None
    peaks = stage_peaks(model, train, hardware, coefficients)
    return peaks[0] if where == "first" else peaks[-1]


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
