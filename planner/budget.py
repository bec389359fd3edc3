"""The estimate's result: per-bucket bytes on the GPU and host, by phase, and the verdict.

``Budget.model_dump()`` is exactly the JSON that ``headroom estimate --format json`` prints.
"""

from __future__ import annotations

from typing import TypeVar

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


_M = TypeVar("_M", bound=_Out)


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


def construct(cls: type[_M], **fields: object) -> _M:
    """Build an output model from values the estimator computed itself, skipping validation.

    ``model_construct`` walks every field's defaults; the estimator supplies all fields with
    the right types, and building a Budget is most of an estimate's cost otherwise.
    """
    obj = cls.__new__(cls)
    setattr_ = object.__setattr__
    setattr_(obj, "__dict__", fields)
    setattr_(obj, "__pydantic_fields_set__", set(fields))
    setattr_(obj, "__pydantic_extra__", None)
    setattr_(obj, "__pydantic_private__", None)
    return obj
