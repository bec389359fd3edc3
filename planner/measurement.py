"""A measurement of one run's GPU memory, as calibration records keep it.

The service's request body (``api.schemas.Measured``), a probe of the bundled trainer, a CPU
trace and a GPU run's own log (``calibration.logs``) all become this one type before the store
compares and keeps it.

A log does not always print the allocator's allocated peak: torchtitan prints the reserved
peak, ``nvidia-smi`` the device's memory in use. A measurement holds whichever of the three
figures its run gave (at least one), and is compared like with like (:attr:`Measurement.figure`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headroom.planner._numbers import Int
from headroom.planner.budget import GPU_BUCKETS, PHASES

PhaseName = Literal[PHASES]  # type: ignore[valid-type]
BucketName = Literal[GPU_BUCKETS]  # type: ignore[valid-type]
#: what a measured number is: the caching allocator's allocated or reserved peak
#: (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), or the device memory in
#: use as ``nvidia-smi`` shows it (the CUDA context and every reserve on the device)
Figure = Literal["max_allocated", "max_reserved", "nvidia_smi_total"]
FIGURES: tuple[Figure, ...] = ("max_allocated", "max_reserved", "nvidia_smi_total")

#: the largest measurement accepted: 1 PiB
MAX_MEASURED_BYTES = 2**50

Bytes = Annotated[Int, Field(gt=0, le=MAX_MEASURED_BYTES)]


class StepMeasurement(BaseModel):
    """What a log printed for one step (or one sample) of one rank: each figure it gave."""

    model_config = ConfigDict(frozen=True)

    step: int | None = Field(default=None, ge=0, description="The training step, where printed.")
    rank: int | None = Field(default=None, ge=0, description="The global rank, where printed.")
    label: str | None = Field(
        default=None, max_length=200, description="What the log called the moment, if anything."
    )
    allocated_bytes: Bytes | None = None
    reserved_bytes: Bytes | None = None
    nvidia_smi_bytes: Bytes | None = None


class Measurement(BaseModel):
    """Measured bytes of one run: its peaks, and what else was observed."""

    model_config = ConfigDict(frozen=True)

    allocated_bytes: Bytes | None = Field(
        default=None, description="Peak allocated bytes on the GPU."
    )
    reserved_bytes: Bytes | None = Field(default=None, description="Peak reserved bytes.")
    nvidia_smi_bytes: Bytes | None = Field(
        default=None,
        description="Peak device memory in use as nvidia-smi shows it (CUDA context included).",
    )
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
    steps: tuple[StepMeasurement, ...] | None = Field(
        default=None, description="Per step (and rank), where the log printed it."
    )
    stage: Literal["first", "last"] | None = Field(
        default=None,
        description="The pipeline stage whose rank measured it (None: the heaviest, or no "
        "pipeline); compared with that stage's estimate.",
    )
    log_format: str | None = Field(
        default=None, max_length=32, description="The log format it was read from, if any."
    )

    @model_validator(mode="after")
    def _has_a_figure(self) -> Measurement:
        figures = (self.allocated_bytes, self.reserved_bytes, self.nvidia_smi_bytes)
        if all(value is None for value in figures):
            raise ValueError(
                "a measurement needs at least one of allocated_bytes, reserved_bytes, "
                "nvidia_smi_bytes"
            )
        return self

    @property
    def figure(self) -> Figure:
        """The figure compared with the estimate: the allocated peak where measured, else the
        reserved peak, else nvidia-smi's total."""
        if self.allocated_bytes is not None:
            return "max_allocated"
        return "max_reserved" if self.reserved_bytes is not None else "nvidia_smi_total"

    @property
    def figure_bytes(self) -> int:
        """The bytes of :attr:`figure`."""
        value = {
            "max_allocated": self.allocated_bytes,
            "max_reserved": self.reserved_bytes,
            "nvidia_smi_total": self.nvidia_smi_bytes,
        }[self.figure]
        assert value is not None
        return value
