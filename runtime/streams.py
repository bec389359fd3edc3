"""Copy engines for the streaming trainer: asynchronous copies ordered by events.

``CudaBackend`` runs host→device and device→host copies on two dedicated streams and orders
them against the compute stream with events. ``CpuBackend`` copies at once (events are no-ops),
so every schedule runs on a CPU. ``DelayedBackend`` is for tests: it queues every copy and
performs it only when an event that depends on it is waited on, in a shuffled order otherwise,
so a consumer that forgets to wait reads stale data; it also checks that no copy targets a
buffer whose previous consumer has not released it.

Host buffers come from ``host_buffer``: exact-size, zeroed and, on CUDA, page-locked by
registering ordinary memory with the driver (``cudaHostRegister``). PyTorch's pinned allocator
rounds every request up to a power of two, which can nearly double the host RAM of a large
layer's state; registration pins exactly what the planner counts.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class Event:
    """Completion marker of an operation (a copy, or compute that used a buffer)."""

    def __init__(self, handle: Any = None) -> None:
        self.handle = handle


PAGE = 4096
_locked = [0]  # host bytes page-locked by CudaBackend.host_buffer and not yet released


def locked_host_bytes() -> int:
    """Host bytes the streaming and offload trainers hold page-locked right now."""
    return _locked[0]


ALIGN = 256  # byte alignment of the views carved out of a host buffer


def carve(buffer: Tensor, fields: list[tuple[str, int, torch.dtype]]) -> dict[str, Tensor]:
    """Flat views of ``buffer`` (uint8), one per (name, numel, dtype), each ALIGN-aligned."""
    out, offset = {}, 0
    for name, numel, dtype in fields:
        size = numel * dtype.itemsize
        out[name] = buffer[offset : offset + size].view(dtype)
        offset += -(-size // ALIGN) * ALIGN
    return out


def carved_bytes(fields: list[tuple[str, int, torch.dtype]]) -> int:
    """The host buffer ``carve`` needs for ``fields``."""
    return sum(-(-numel * dtype.itemsize // ALIGN) * ALIGN for _, numel, dtype in fields)


class CpuBackend:
    """Synchronous copies on the host; every event is already complete."""

    name = "cpu"
    pinning = "none"  # how host buffers are page-locked: none | registered | torch

    def __init__(self) -> None:
        self.host_bytes = 0  # bytes handed out by host_buffer

    def host_buffer(self, nbytes: int) -> Tensor:
        """``nbytes`` of zeroed host memory (uint8) that copies to the device can stream from."""
        self.host_bytes += nbytes
        return torch.zeros(nbytes, dtype=torch.uint8)

    def pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.host_buffer(numel * dtype.itemsize).view(dtype)

    def release_host(self) -> None:
        """Give back what ``host_buffer`` locked (the buffers stay valid as ordinary memory)."""

    def h2d(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        dst.copy_(src)
        return Event()

    def d2h(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        dst.copy_(src)
        return Event()

    def record(self) -> Event:
        """An event on the compute stream (compute so far is done when it completes)."""
        return Event()

    def wait(self, event: Event | None) -> None:
        """Make the compute stream wait for ``event``."""

    def synchronize(self, event: Event | None) -> None:
        """Block the host until ``event`` completes."""


class CudaBackend(CpuBackend):
    """Dedicated H2D and D2H streams; events order them against the compute stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)
        self.pinning = "registered"
        self._registered: list[tuple[int, int]] = []  # (address, bytes) locked

    def host_buffer(self, nbytes: int) -> Tensor:
        # whole pages of an allocation of our own, so no other allocation shares a locked page
        span = -(-max(nbytes, 1) // PAGE) * PAGE
        raw = torch.zeros(span + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        region = raw[start : start + span]
        code = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0))
        self.host_bytes += nbytes
        if code != 0:  # registration refused: fall back to the (power-of-two) pinned allocator
            self.pinning = "torch"
            return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        self._registered.append((region.data_ptr(), span))
        _locked[0] += span
        return region[:nbytes]

    def release_host(self) -> None:
        for ptr, span in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
            _locked[0] -= span
        self._registered.clear()

    def _copy(self, stream: Any, dst: Tensor, src: Tensor, after: Event | None) -> Event:
        with torch.cuda.stream(stream):
            if after is not None and after.handle is not None:
                stream.wait_event(after.handle)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Event(event)

    def h2d(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        return self._copy(self.h2d_stream, dst, src, after)

    def d2h(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        # the gradient was produced on the compute stream: order the copy after it
        return self._copy(self.d2h_stream, dst, src, after or self.record())

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Event(event)

    def wait(self, event: Event | None) -> None:
        if event is not None and event.handle is not None:
            torch.cuda.current_stream(self.device).wait_event(event.handle)

    def synchronize(self, event: Event | None) -> None:
        if event is not None and event.handle is not None:
            event.handle.synchronize()


@dataclass(eq=False)
class _Copy:
    dst: Tensor
    src: Tensor
    done: bool = False


@dataclass
class DelayedBackend(CpuBackend):
    """Test backend: copies happen late and out of order unless an event forces them."""

    seed: int = 0
    drift: float = 0.3  # chance that a pending copy completes at each later copy
    name: str = "delayed"
    pending: list[_Copy] = field(default_factory=list)
    copies: int = 0
    waited: int = 0

    def __post_init__(self) -> None:
        super().__init__()
        self.rng = random.Random(self.seed)
        self.lock = threading.Lock()  # the trainer's host thread waits on copies too

    def _enqueue(self, dst: Tensor, src: Tensor) -> Event:
        # the copy reads its source and writes its destination only when it completes, as an
        # asynchronous copy on another stream would
        copy = _Copy(dst, src)
        with self.lock:
            self.pending.append(copy)
            self.copies += 1
            self._drift()
        return Event(copy)

    def _drift(self) -> None:
        """Complete a random subset of pending copies, in a random order."""
        self.rng.shuffle(self.pending)
        keep = []
        for copy in self.pending:
            if self.rng.random() < self.drift:
                copy.dst.copy_(copy.src)
                copy.done = True
            else:
                keep.append(copy)
        self.pending = keep

    def h2d(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        return self._enqueue(dst, src)

    def d2h(self, dst: Tensor, src: Tensor, after: Event | None = None) -> Event:
        return self._enqueue(dst, src)

    def _complete(self, event: Event | None) -> None:
        if event is None or not isinstance(event.handle, _Copy):
            return
        copy = event.handle
        with self.lock:
            if not copy.done:
                copy.dst.copy_(copy.src)
                copy.done = True
                self.pending.remove(copy)
            self.waited += 1

    def wait(self, event: Event | None) -> None:
        self._complete(event)

    def synchronize(self, event: Event | None) -> None:
        self._complete(event)

    def unwaited(self) -> int:
        """Copies issued that were never completed by a wait."""
        return len(self.pending)


def make_backend(device: torch.device) -> CpuBackend:
    return CudaBackend(device) if device.type == "cuda" else CpuBackend()
