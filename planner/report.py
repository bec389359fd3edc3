"""The bundled trainer's report (``headroom train --report``): one typed model, written by the
trainer and read by the launch layer (a run's outcome, a probe's) and calibration.

The JSON keeps only the keys the trainer set: a CPU snapshot has no reserved bytes, a run that
ran out of memory has no losses, so ``dump`` leaves unset fields out rather than writing nulls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from headroom.planner.train import TrainSpec


class _Report(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PhaseSnapshot(_Report):
    """The memory probe after one phase of one step; the device counters exist on CUDA only,
    a simulated device (``--memory-cap`` on a CPU) counts allocated bytes alone."""

    phase: str = Field(description="placement, forward, backward or optimizer.")
    step: int = Field(description="The optimizer step (0: placement, before step 1).")
    allocated_bytes: int
    allocated_peak_bytes: int = Field(description="Allocated peak since the previous phase.")
    reserved_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    active_peak_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_free_bytes: int | None = None
    device_total_bytes: int | None = None
    host_registered_bytes: int | None = None
    host_allocator_pinned_bytes: int | None = None


class FailedRequest(_Report):
    """The allocation a simulated device refused, and what it held when it did."""

    requested_bytes: int
    live_bytes: int


class SimulatedDevice(_Report):
    """A CPU run under a ``DeviceCap``: the cap's own count of live device storages."""

    cap_bytes: int
    allocated_peak_bytes: int
    failed_request: FailedRequest | None = None
    phases: list[PhaseSnapshot] = Field(default_factory=list)


class MemoryReport(_Report):
    """What the memory probe saw: CUDA's allocator counters, or on a CPU why there are none
    (and the simulated device's count, under a cap)."""

    available: bool = False
    reason: str | None = None
    simulated: SimulatedDevice | None = None
    device: str | None = None
    allocator_config: str | None = None
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    phases: list[PhaseSnapshot] = Field(default_factory=list)

    @property
    def measured_phases(self) -> list[PhaseSnapshot]:
        """The snapshots measured: the device's, else the simulated device's."""
        if self.available:
            return self.phases
        return self.simulated.phases if self.simulated is not None else []

    @property
    def measured_peak_bytes(self) -> int | None:
        """The allocated peak the run reached (None: nothing measured); after a simulated
        out-of-memory at least what it held plus what it asked for."""
        if self.available:
            return self.allocated_peak_bytes
        if self.simulated is None:
            return None
        failed = self.simulated.failed_request
        if failed is not None:
            needed = failed.live_bytes + failed.requested_bytes
            return max(self.simulated.allocated_peak_bytes or 0, needed)
        return self.simulated.allocated_peak_bytes


class OutOfMemoryAt(_Report):
    """Where an out-of-memory error struck: the phase after the last that completed."""

    phase: str
    step: int
    after: str | None = Field(default=None, description="The last phase that completed.")
    message: str = ""


class TrainerReport(_Report):
    """``headroom train``'s report (every field optional: a reader may find a partial one)."""

    model: str | None = None
    train: TrainSpec | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    memory_cap_bytes: int | None = None
    losses: list[float] | None = Field(default=None, description="One per completed step.")
    steps: int | None = None
    tokens_per_second: float | None = None
    placement: dict[str, Any] | None = None
    attention_kv: str | None = None
    oom: OutOfMemoryAt | None = None
    memory: MemoryReport | None = None

    @property
    def completed_steps(self) -> int:
        return len(self.losses or [])

    def dump(self) -> dict[str, Any]:
        """The report as JSON data, with only the keys the trainer set (and the whole training
        spec: its defaults are what the trainer ran)."""
        out = self.model_dump(mode="json", exclude_unset=True)
        if self.train is not None and "train" in out:
            out["train"] = self.train.model_dump(mode="json")
        return out


def read_report(path: Path) -> TrainerReport:
    """The report at ``path``; an empty one if the trainer wrote none (or an unreadable one)."""
    try:
        data = json.loads(path.read_text())
        return TrainerReport.model_validate(data)
    except (OSError, ValueError, ValidationError):
        return TrainerReport()
