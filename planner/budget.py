"""The estimate's result: per-bucket bytes on the GPU and host, by phase, and the verdict.

``Budget.model_dump()`` is exactly the JSON that ``headroom estimate --format json`` prints.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: GPU buckets, in the order of shared/DESIGN.md
GPU_BUCKETS: tuple[str, ...] = (
    "params",
    "grads",
    "master_params",
    "optimizer_states",
    "ema",
    "activations",
    "logits",
    "moe_dispatch",
    "transfer_buffers",
    "cuda_context",
    "allocator_overhead",
)

#: host buckets: the same names, for what lives in host RAM
HOST_BUCKETS: tuple[str, ...] = (
    "params",
    "grads",
    "master_params",
    "optimizer_states",
    "ema",
    "transfer_buffers",
)

#: phases of a training step, in time order; step 1 runs before optimizer state exists
PHASES: tuple[str, ...] = (
    "step1_forward",
    "step1_backward",
    "forward",
    "backward",
    "optimizer",
)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class ModelSummary(_Out):
    name: str
    params_total: int
    params_active_per_token: int
    params_mtp_excluded: int


class PhaseBudget(_Out):
    total_bytes: int
    buckets: dict[str, int]


class GpuBudget(_Out):
    name: str
    capacity_bytes: int
    peak_bytes: int
    headroom_bytes: int
    buckets: dict[str, int]
    phases: dict[str, PhaseBudget]


class HostBudget(_Out):
    capacity_bytes: int | None
    peak_bytes: int
    headroom_bytes: int | None
    ranks_sharing: int
    buckets: dict[str, int]


class CoefficientsUsed(_Out):
    profile: str
    device: str | None
    calibrated: bool
    source: str
    margin_fraction: float


class Budget(_Out):
    """Where every byte goes on the heaviest rank, and whether it fits."""

    model: ModelSummary
    gpu: GpuBudget
    host: HostBudget
    peak_phase: str
    fits: bool
    stage: int
    margin_bytes: int
    coefficients: CoefficientsUsed
    warnings: list[str]
