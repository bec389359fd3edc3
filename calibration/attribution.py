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

Pure arithmetic over the snapshots (``planner.report.PhaseSnapshot``): no torch, usable on
stored reports.
"""

from __future__ import annotations

from collections.abc import Sequence

from headroom.planner.report import PhaseSnapshot


def _at(phases: Sequence[PhaseSnapshot], phase: str, step: int) -> PhaseSnapshot | None:
    return next((p for p in phases if p.phase == phase and p.step == step), None)


def attribute(phases: Sequence[PhaseSnapshot]) -> dict[str, int]:
    """What the snapshots of one run attribute (module docstring); keys only where measured."""
    out: dict[str, int] = {}
    placed = _at(phases, "placement", 0)
    if placed is not None:
        out["resident_bytes"] = placed.allocated_bytes
        stepped = _at(phases, "optimizer", 1)
        if stepped is not None:
            out["optimizer_state_bytes"] = stepped.allocated_bytes - out["resident_bytes"]
    # the last forward, and what was allocated when it started (the snapshot before it)
    for i in range(len(phases) - 1, 0, -1):
        if phases[i].phase == "forward":
            before = phases[i - 1].allocated_bytes
            out["forward_transient_bytes"] = phases[i].allocated_bytes - before
            out["forward_peak_bytes"] = phases[i].allocated_peak_bytes - before
            break
    reserved = [p.reserved_peak_bytes for p in phases if p.reserved_peak_bytes is not None]
    if reserved:
        allocated = max(p.allocated_peak_bytes for p in phases)
        out["allocator_overhead_bytes"] = max(max(reserved) - allocated, 0)
    moments = [
        (p.device_total_bytes - p.device_free_bytes, p.reserved_bytes)
        for p in phases
        if p.reserved_bytes is not None
        and p.device_total_bytes is not None
        and p.device_free_bytes is not None
    ]
    if moments:
        used, reserved_now = moments[-1]
        out["context_bytes"] = max(used - reserved_now, 0)
    return out
