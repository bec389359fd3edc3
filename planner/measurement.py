"""A measurement of one run's GPU memory, as calibration records keep it.

The service's request body (``api.schemas.Measured``), a probe of the bundled trainer and a CPU
trace all become this one type before the store compares and keeps it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from headroom.planner._numbers import Int
from headroom.planner.budget import GPU_BUCKETS, PHASES

PhaseName = Literal[PHASES]  # type: ignore[valid-type]
BucketName = Literal[GPU_BUCKETS]  # type: ignore[valid-type]

#: the largest measurement accepted: 1 PiB
MAX_MEASURED_BYTES = 2**50


class Measurement(BaseModel):
    """Measured bytes of one run: the allocated peak, and what else was observed."""

    model_config = ConfigDict(frozen=True)

    allocated_bytes: Int = Field(
        gt=0, le=MAX_MEASURED_BYTES, description="Peak allocated bytes on the GPU."
    )
    reserved_bytes: Int | None = Field(default=None, gt=0, le=MAX_MEASURED_BYTES)
    phase: PhaseName | None = Field(default=None, description="Phase the peak was measured in.")
    buckets: dict[BucketName, Annotated[Int, Field(ge=0, le=MAX_MEASURED_BYTES)]] | None = Field(
        default=None, description="Measured bytes per GPU bucket, where attributable."
    )
    forward_transient_bytes: Int | None = Field(
        default=None,
        ge=0,
        le=MAX_MEASURED_BYTES,
        description="Transient bytes (activations, logits, MoE dispatch) live at the end of a "
        "steady-state forward, where measured (CPU traces): what calibrate fit fits the "
        "activation terms to.",
    )
