"""A device-memory cap for a CPU run: out-of-memory without a GPU.

``DeviceCap`` counts the bytes of every tensor storage that device-side work creates, from its
creation until its last reference dies (a weak reference on the storage), and raises
``torch.OutOfMemoryError`` when a new storage would take the count past the cap, as the CUDA
caching allocator does when a card is full. The trainer marks its host-side work (pinned host
buffers, the CPU optimizer, copies of the final state) with ``host()``: on a CPU both sides are
the same memory, and only the device side counts.

The count is of live storages, so it is the allocated bytes a CUDA run would report without the
allocator's rounding and caching; ``peak_bytes`` is its high-water mark. On CUDA the cap is the
real allocator's, ``torch.cuda.set_per_process_memory_fraction``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_active: list[DeviceCap] = []


class DeviceCap(TorchDispatchMode):
    """Live device bytes on a CPU run, capped at ``cap_bytes`` (see the module docstring)."""

    def __init__(self, cap_bytes: int) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak_bytes = 0
        self.paused = 0
        self.failed_request: tuple[int, int] | None = None  # (bytes requested, bytes live)
        self._live: dict[int, int] = {}
        # storages die on any thread (the streaming trainer's host thread drops gradients)
        self._lock = threading.RLock()  # a finalizer may run inside _track (gc)

    def __enter__(self) -> DeviceCap:
        _active.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _active.remove(self)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)
            }
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if not nbytes or key in self._live or key in inputs:
                return  # nothing allocated, already counted, or a view / in-place result
            if self.live_bytes + nbytes > self.cap_bytes:
                self.failed_request = (nbytes, self.live_bytes)
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: tried to allocate {nbytes} bytes with "
                    f"{self.live_bytes} of {self.cap_bytes} bytes in use"
                )
            self._live[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.window_peak_bytes = max(self.window_peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self.live_bytes -= nbytes

    def take_window_peak(self) -> int:
        """The peak since the previous call (a phase's peak), then start a new window."""
        peak = self.window_peak_bytes
        self.window_peak_bytes = self.live_bytes
        return peak


@contextmanager
def host() -> Iterator[None]:
    """Host-side work: not counted against an active ``DeviceCap`` (no-op without one)."""
    cap = _active[-1] if _active else None
    if cap is None:
        yield
        return
    cap.paused += 1
    try:
        yield
    finally:
        cap.paused -= 1
