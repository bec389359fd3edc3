"""Attribute a probed run's per-phase memory snapshots to what holds the bytes.

The runtime's memory probe (``runtime.probe``) records, after each phase of each step, the
allocated bytes, the allocated and reserved peaks since the previous phase and, on CUDA, the
driver's free and total memory. Their differences say:

- ``resident_bytes``: allocated after placement, before step 1 (parameters and the state placed
  with them: master weights, EMA, streaming buffers);
- ``optimizer_state_bytes``: allocated after step 1's optimizer minus that (the optimizer's
  state is created lazily by the first step);
- ``forward_transient_bytes``: allocated at the end of the steady-state (last) forward minus
  what was allocated when it began: the activations, logits and MoE dispatch it keeps for
  backward (what ``calibrate fit`` fits activation terms to); ``forward_peak_bytes``: the same
  from the forward's allocated peak;
- ``allocator_overhead_bytes``: the reserved peak minus the allocated peak (CUDA only);
- ``context_bytes``: memory the device used beyond the allocator's reservation (CUDA context,
  and anything else on the card), where the probe read both at one moment.

Pure arithmetic over the snapshots: no torch, usable on stored reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _at(phases: Sequence[dict[str, Any]], phase: str, step: int) -> dict[str, Any] | None:
    return next((p for p in phases if p["phase"] == phase and p["step"] == step), None)


def attribute(phases: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What the snapshots of one run attribute (module docstring); keys only where measured."""
    out: dict[str, int] = {}
    placed = _at(phases, "placement", 0)
    if placed is not None:
        out["resident_bytes"] = int(placed["allocated_bytes"])
        stepped = _at(phases, "optimizer", 1)
        if stepped is not None:
            out["optimizer_state_bytes"] = int(stepped["allocated_bytes"]) - out["resident_bytes"]
    # the last forward, and what was allocated when it started (the snapshot before it)
    for i in range(len(phases) - 1, 0, -1):
        if phases[i]["phase"] == "forward":
            before = int(phases[i - 1]["allocated_bytes"])
            out["forward_transient_bytes"] = int(phases[i]["allocated_bytes"]) - before
            out["forward_peak_bytes"] = int(phases[i]["allocated_peak_bytes"]) - before
            break
    reserved = [p["reserved_peak_bytes"] for p in phases if "reserved_peak_bytes" in p]
    if reserved:
        allocated = max(int(p["allocated_peak_bytes"]) for p in phases)
        out["allocator_overhead_bytes"] = max(int(max(reserved)) - allocated, 0)
    moments = [p for p in phases if "reserved_bytes" in p and "device_total_bytes" in p]
    if moments:
        last = moments[-1]
        used = int(last["device_total_bytes"]) - int(last["device_free_bytes"])
        out["context_bytes"] = max(used - int(last["reserved_bytes"]), 0)
    return out
