"""Copy engines for the streaming trainer: asynchronous copies ordered by events.

``CudaBackend`` runs host→device and device→host copies on two dedicated streams and orders
them against the compute stream with events. ``CpuBackend`` copies at once (events are no-ops),
so every schedule runs on a CPU. ``DelayedBackend`` is for tests: it queues every copy and
performs it only when an event that depends on it is waited on, in a shuffled order otherwise,
so a consumer that forgets to wait reads stale data; it also checks that no copy targets a
buffer whose previous consumer has not released it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class Event:
    """Completion marker of an operation (a copy, or compute that used a buffer)."""

    def __init__(self, handle: Any = None) -> None:
        self.handle = handle


class CpuBackend:
    """Synchronous copies on the host; every event is already complete."""

    name = "cpu"

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

    def pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype)


class CudaBackend(CpuBackend):
    """Dedicated H2D and D2H streams; events order them against the compute stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)

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

    def pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=True)


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
        self.rng = random.Random(self.seed)

    def _enqueue(self, dst: Tensor, src: Tensor) -> Event:
        # the copy reads its source and writes its destination only when it completes, as an
        # asynchronous copy on another stream would
        copy = _Copy(dst, src)
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
