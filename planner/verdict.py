"""The launch gate's verdict on an estimate: fits, predicted OOM, or cannot decide."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from headroom.planner.budget import Budget
from headroom.planner.units import format_bytes

#: exit codes of ``headroom gate`` (2 is invalid input, raised before a verdict exists)
EXIT_FITS, EXIT_OOM, EXIT_UNDECIDED = 0, 1, 3


class Verdict(BaseModel):
    """Whether to launch, with the numbers behind it."""

    decision: Literal["fits", "oom", "undecided"]
    exit_code: int
    fits: bool | None
    reason: str
    peak_phase: str
    gpu_peak_bytes: int
    gpu_capacity_bytes: int
    margin_bytes: int
    headroom_bytes: int
    host_peak_bytes: int
    host_capacity_bytes: int | None
    calibrated: bool
    warnings: list[str] = Field(
        default_factory=list, description="The estimate's warnings (what it assumed)."
    )


def gate(
    budget: Budget, margin_pct: float | None = None, require_calibration: bool = False
) -> Verdict:
    """Judge ``budget``: the peak plus the margin (``margin_pct`` % of the peak, default the
    coefficients' margin) must fit the GPU, and host RAM must hold the host buckets."""
    gpu, host = budget.gpu, budget.host
    peak = gpu.peak_bytes
    margin = budget.margin_bytes if margin_pct is None else math.ceil(peak * margin_pct / 100)
    calibrated = budget.coefficients.calibrated
    common = {
        "peak_phase": budget.peak_phase,
        "gpu_peak_bytes": peak,
        "gpu_capacity_bytes": gpu.capacity_bytes,
        "margin_bytes": margin,
        "headroom_bytes": gpu.capacity_bytes - peak - margin,
        "host_peak_bytes": host.peak_bytes,
        "host_capacity_bytes": host.capacity_bytes,
        "calibrated": calibrated,
        "warnings": list(budget.warnings),
    }
    if require_calibration and not calibrated:
        return Verdict(
            decision="undecided",
            exit_code=EXIT_UNDECIDED,
            fits=None,
            reason=f"calibration required, but the '{budget.coefficients.profile}' coefficients "
            "are uncalibrated for this GPU",
            **common,
        )
    if peak + margin > gpu.capacity_bytes:
        reason = (
            f"predicted GPU peak {format_bytes(peak)} in {budget.peak_phase} plus margin "
            f"{format_bytes(margin)} exceeds capacity {format_bytes(gpu.capacity_bytes)}"
        )
        return Verdict(decision="oom", exit_code=EXIT_OOM, fits=False, reason=reason, **common)
    if host.capacity_bytes is not None and host.peak_bytes > host.capacity_bytes:
        reason = (
            f"host RAM {format_bytes(host.peak_bytes)} exceeds capacity "
            f"{format_bytes(host.capacity_bytes)}"
        )
        return Verdict(decision="oom", exit_code=EXIT_OOM, fits=False, reason=reason, **common)
    return Verdict(
        decision="fits",
        exit_code=EXIT_FITS,
        fits=True,
        reason=f"predicted GPU peak {format_bytes(peak)} + margin {format_bytes(margin)} within "
        f"{format_bytes(gpu.capacity_bytes)}",
        **common,
    )
