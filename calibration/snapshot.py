"""A CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``'s pickle) read as a measurement.

The snapshot (``torch.cuda.memory._snapshot()``; the schema in ``torch/cuda/memory.py``'s
docstring and ``THCPModule_memorySnapshot`` in ``torch/csrc/cuda/Module.cpp``) holds, per
device, the allocator's segments at the moment it was taken (each with its blocks: ``size``,
``requested_size``, ``state`` ``active_allocated`` / ``active_pending_free`` / ``inactive``) and
the trace of what happened before (``device_traces``: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``,
``snapshot``, ``oom``; each with ``addr``, ``size`` and the Python ``frames`` that made it).

The allocated total is replayed as PyTorch's own viewer does (``torch/utils/viz/MemoryViz.js``,
``process_alloc_data``): ``alloc`` adds its size, ``free_completed`` takes it away,
``free_requested`` changes nothing. The trace is a ring buffer that may begin mid-run, so the
total before its first entry is what the segments hold at the end less the trace's net change;
reserved bytes are replayed the same way from the segment events. Sizes are the requested
bytes the trace records (``max_memory_allocated`` counts the blocks, rounded up to 512 bytes).

Each allocation's phase is read from its frames: under ``torch/optim/`` the optimizer, under
``Tensor.backward`` / ``torch.autograd.backward`` the backward, under a module's ``forward`` the
forward, else set-up. Each step's forward, backward and optimizer step get their own peak (the
trace's first forward is taken for the run's first step: record the history before it). At the
run's peak the live allocations are attributed where their frames allow: set-up to ``params``,
the forward's to ``activations``, the optimizer's to ``optimizer_states`` (outside the
optimizer's own step, where its temporaries are live too), and the backward's by their
lifetime: what a backward makes and keeps past its end (freed in a later phase, or not within
the trace) is the gradients it leaves in ``.grad`` (``grads``); what it frees before it ends
(activation gradients, its temporaries) is left out.

The pickle is read with an unpickler that refuses every class and function: a snapshot is
plain dicts, lists, tuples, strings and numbers, and anything else is refused unread.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from headroom.calibration.logs import LogError
from headroom.planner.measurement import StepMeasurement

_ADDS = {"alloc": 1, "free_completed": -1}
_SEGMENT = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only: any class or function in the stream is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise LogError(
            f"a memory snapshot holds plain data only; this pickle names {module}.{name}, "
            "which is not read"
        )


def _load(data: bytes, name: str) -> dict[str, Any]:
    try:
        snap = _PlainData(io.BytesIO(data)).load()
    except LogError as exc:
        raise LogError(f"{name}: {exc}") from None
    except Exception as exc:  # a truncated or corrupt pickle raises any of several types
        raise LogError(
            f"{name}: not a whole memory snapshot pickle ({type(exc).__name__}: {exc}); "
            "write it with torch.cuda.memory._dump_snapshot"
        ) from None
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise LogError(f"{name}: a memory snapshot is a dict with 'segments' and 'device_traces'")
    if not isinstance(snap.get("device_traces"), list):
        raise LogError(f"{name}: the snapshot has no 'device_traces' (record the history first)")
    return snap


def phase_of(frames: Iterable[dict[str, Any]]) -> str | None:
    """The phase an allocation was made in, from its Python frames (None: set-up)."""
    found = None
    for frame in frames:
        filename = str(frame.get("filename", "")).replace("\\", "/")
        func = str(frame.get("name", ""))
        if "/torch/optim/" in filename:
            return "optimizer"
        if func in ("backward", "_engine_run_backward") and (
            filename.endswith("torch/_tensor.py") or "/torch/autograd/" in filename
        ):
            return "backward"
        if func == "forward" and found is None:
            found = "forward"
    return found


@dataclass
class _Replay:
    """The running totals of one device's trace."""

    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    peak_reserved: int = 0
    peak_phase: str | None = None
    peak_live: dict[str, int] = field(default_factory=dict)
    phases: list[tuple[int, str, int]] = field(default_factory=list)  # (step, phase, peak)


def _entries(trace: Any, name: str, device: int) -> list[dict[str, Any]]:
    if not isinstance(trace, list) or not all(isinstance(e, dict) for e in trace):
        raise LogError(f"{name}: device_traces[{device}] is not a list of trace entries")
    for i, entry in enumerate(trace):
        if entry.get("action") in (*_ADDS, *_SEGMENT) and not isinstance(entry.get("size"), int):
            action = entry.get("action")
            raise LogError(f"{name}: device_traces[{device}][{i}] ({action}) has no size")
    return trace


def _final(segments: list[Any], device: int, name: str) -> tuple[int, int]:
    """(allocated, reserved) bytes the device's segments hold at the snapshot."""
    allocated = reserved = 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("total_size"), int):
            raise LogError(f"{name}: segments[{i}] has no total_size")
        if seg.get("device", 0) != device:
            continue
        reserved += seg["total_size"]
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                allocated += int(block.get("requested_size", block.get("size", 0)))
    return allocated, reserved


def _outliving(entries: list[dict[str, Any]]) -> set[int]:
    """The indices of the backward's allocations that outlive it: freed in a later phase or
    never (within the trace). What a backward makes and keeps is the gradients it leaves in
    ``.grad``; what it frees before it ends is activation gradients and its temporaries."""
    made: dict[int, int] = {}  # addr -> index of the backward allocation live there
    kept: set[int] = set()
    phase = None
    for i, entry in enumerate(entries):
        action = entry.get("action")
        if action == "alloc":
            now = phase_of(entry.get("frames") or [])
            phase = now if now is not None else phase
            if now == "backward":
                made[int(entry.get("addr", 0))] = i
                kept.add(i)
        elif action == "free_completed":
            at = made.pop(int(entry.get("addr", 0)), None)
            if at is not None and phase == "backward":
                kept.discard(at)  # freed within its backward
    return kept


def _replay(entries: list[dict[str, Any]], allocated: int, reserved: int) -> _Replay:
    net = sum(e["size"] * _ADDS[e["action"]] for e in entries if e.get("action") in _ADDS)
    net_reserved = sum(
        e["size"] * _SEGMENT[e["action"]] for e in entries if e.get("action") in _SEGMENT
    )
    r = _Replay(allocated=allocated - net, reserved=reserved - net_reserved)
    r.peak, r.peak_reserved = r.allocated, r.reserved
    live: dict[int, tuple[int, str | None]] = {}
    kept = _outliving(entries)
    step, phase, phase_peak = 0, None, 0
    for index, entry in enumerate(entries):
        action = entry.get("action")
        if action in _SEGMENT:
            r.reserved += entry["size"] * _SEGMENT[action]
            r.peak_reserved = max(r.peak_reserved, r.reserved)
            continue
        if action not in _ADDS:
            continue
        addr = int(entry.get("addr", 0))
        if action == "alloc":
            now = phase_of(entry.get("frames") or [])
            if now is not None and now != phase:
                if phase is not None:
                    r.phases.append((step, phase, phase_peak))
                if now == "forward" and phase in (None, "optimizer", "backward"):
                    step += phase != "forward"
                phase, phase_peak = now, r.allocated
            r.allocated += entry["size"]
            made_in = "grads" if now == "backward" and index in kept else now
            live[addr] = (entry["size"], made_in if step else None)
        else:
            r.allocated -= entry["size"]
            live.pop(addr, None)
        phase_peak = max(phase_peak, r.allocated)
        if r.allocated > r.peak:
            r.peak = r.allocated
            r.peak_phase = _phase_name(step, phase)
            by: dict[str, int] = {}
            for size, made_in in live.values():
                key = made_in or "setup"
                by[key] = by.get(key, 0) + size
            r.peak_live = by
    if phase is not None:
        r.phases.append((step, phase, phase_peak))
    return r


def _phase_name(step: int, phase: str | None) -> str | None:
    if phase is None or step == 0:
        return None
    if phase == "optimizer":
        return "optimizer"
    return f"step1_{phase}" if step == 1 else phase


def buckets_at_peak(replay: _Replay) -> dict[str, int]:
    """The live bytes at the peak the frames attribute to a bucket (module docstring)."""
    out = {}
    if replay.peak_live.get("setup"):
        out["params"] = replay.peak_live["setup"]
    if replay.peak_live.get("grads"):
        out["grads"] = replay.peak_live["grads"]
    if replay.peak_live.get("forward"):
        out["activations"] = replay.peak_live["forward"]
    if replay.peak_live.get("optimizer") and replay.peak_phase != "optimizer":
        out["optimizer_states"] = replay.peak_live["optimizer"]
    return out


@dataclass(frozen=True)
class SnapshotReading:
    """What one device's trace gave."""

    device: int
    allocated_peak: int
    reserved_peak: int
    peak_phase: str | None
    buckets: dict[str, int]
    phases: tuple[tuple[int, str, int], ...]


def read_devices(data: bytes, name: str) -> list[SnapshotReading]:
    """Every device's replayed peaks in a snapshot pickle; one whose parts are not what torch
    writes (a segment, block, trace entry or frame of another shape) refused naming it."""
    snap = _load(data, name)
    try:
        return _devices(snap, name)
    except LogError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise LogError(
            f"{name}: not a memory snapshot as torch writes it ({type(exc).__name__}: {exc})"
        ) from None


def _devices(snap: dict[str, Any], name: str) -> list[SnapshotReading]:
    out = []
    for device, trace in enumerate(snap["device_traces"]):
        entries = _entries(trace, name, device)
        allocated, reserved = _final(snap["segments"], device, name)
        if not entries and not allocated:
            continue
        replay = _replay(entries, allocated, reserved)
        out.append(
            SnapshotReading(
                device=device,
                allocated_peak=replay.peak,
                reserved_peak=replay.peak_reserved,
                peak_phase=replay.peak_phase,
                buckets=buckets_at_peak(replay),
                phases=tuple(replay.phases),
            )
        )
    if not out:
        raise LogError(f"{name}: the snapshot's devices hold nothing and traced nothing")
    return out


def snapshot_steps(devices: list[SnapshotReading]) -> list[StepMeasurement]:
    """Per device, each step phase's allocated peak, then the device's whole peaks."""
    out: list[StepMeasurement] = []
    for reading in devices:
        for step, phase, peak in reading.phases:
            if step and peak > 0:
                out.append(
                    StepMeasurement(
                        step=step, rank=reading.device, label=phase, allocated_bytes=peak
                    )
                )
        out.append(
            StepMeasurement(
                rank=reading.device,
                label="peak",
                allocated_bytes=max(1, reading.allocated_peak),
                reserved_bytes=reading.reserved_peak or None,
            )
        )
    return out
