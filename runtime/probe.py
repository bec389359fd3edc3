"""Memory probe: what the CUDA caching allocator saw in each phase of each step.

Per phase (placement, forward, backward, optimizer; step 1 and the steady state) it records the
allocator's allocated, reserved and active peaks since the previous phase, ``num_alloc_retries``
and ``num_ooms``, the driver's free and total memory, the page-locked host bytes, and the
allocator configuration. On a CPU there are no device counters: the report says so and invents
none. A CPU run under a
``DeviceCap`` (``headroom train --memory-cap``) reports the cap's own count of live device
storages per phase instead, marked ``simulated``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from headroom.planner.report import MemoryReport
from headroom.runtime.cap import DeviceCap
from headroom.runtime.streams import locked_host_bytes


def _host_pinned() -> dict[str, int]:
    """Page-locked host bytes: the trainer's registered buffers and, where this PyTorch reports
    it, what its own pinned-memory allocator holds."""
    out = {"host_registered_bytes": locked_host_bytes()}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None:
        held = stats().get("allocated_bytes.current")
        if held is not None:
            out["host_allocator_pinned_bytes"] = int(held)
    return out


class MemoryProbe:
    """Callable phase hook for ``runtime.trainer.train_model``."""

    def __init__(self, device: torch.device, cap: DeviceCap | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cap = cap
        self.snapshots: list[dict[str, Any]] = []
        self.last: tuple[str, int] | None = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def __call__(self, phase: str, step: int) -> None:
        self.last = (phase, step)
        if not self.cuda:
            if self.cap is not None:
                self.snapshots.append(
                    {
                        "phase": phase,
                        "step": step,
                        "allocated_bytes": self.cap.live_bytes,
                        "allocated_peak_bytes": self.cap.take_window_peak(),
                    }
                )
            return
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        self.snapshots.append(
            {
                "phase": phase,
                "step": step,
                "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
                "allocated_peak_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
                "reserved_peak_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
                "active_peak_bytes": int(stats.get("active_bytes.all.peak", 0)),
                "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "num_ooms": int(stats.get("num_ooms", 0)),
                "device_free_bytes": int(free),
                "device_total_bytes": int(total),
                **_host_pinned(),
            }
        )
        torch.cuda.reset_peak_memory_stats(self.device)

    def failing_phase(self) -> dict[str, Any]:
        """Where an out-of-memory error struck: the phase after the last one that completed."""
        if self.last is None:
            return {"phase": "placement", "step": 0}
        phase, step = self.last
        following = {"placement": ("forward", 1), "forward": ("backward", step)}
        if phase in following:
            name, at = following[phase]
            return {"phase": name, "step": at, "after": phase}
        if phase == "backward":
            return {"phase": "forward or optimizer", "step": step, "after": phase}
        return {"phase": "forward", "step": step + 1, "after": phase}

    def report(self) -> MemoryReport:
        """What the probe saw, as the trainer's report keeps it."""
        return MemoryReport.model_validate(self._report())

    def _report(self) -> dict[str, Any]:
        if not self.cuda:
            out: dict[str, Any] = {
                "available": False,
                "reason": f"device {self.device.type}: allocator counters exist only on CUDA; "
                "none are reported",
            }
            if self.cap is not None:
                out["simulated"] = {
                    "cap_bytes": self.cap.cap_bytes,
                    "allocated_peak_bytes": self.cap.peak_bytes,
                    "failed_request": None
                    if self.cap.failed_request is None
                    else {
                        "requested_bytes": self.cap.failed_request[0],
                        "live_bytes": self.cap.failed_request[1],
                    },
                    "phases": self.snapshots,
                }
            return out
        peak = max((s["allocated_peak_bytes"] for s in self.snapshots), default=0)
        reserved = max((s["reserved_peak_bytes"] for s in self.snapshots), default=0)
        return {
            "available": True,
            "device": torch.cuda.get_device_name(self.device),
            "allocator_config": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "allocated_peak_bytes": peak,
            "reserved_peak_bytes": reserved,
            "phases": self.snapshots,
        }
