"""The interpreter settings a serving process runs with, so the event loop keeps answering
(health checks, preset estimates) while planner threads compute.

A search is pure Python: while it runs, its thread holds the GIL, and every other thread (the
event loop, a database route's thread) gets it back only when the holder is made to let go.
Measured on a 2-core VM with four of the heaviest searches at once (docs/PERFORMANCE.md), the
event loop stalled for 100-140 ms at a time, and nearly every stall was a full garbage
collection: the searches make hundreds of thousands of short-lived tuples, so young
collections ran every 700 allocations and full ones, each scanning every object the process
holds (its modules, the app, the presets), every few hundred milliseconds.

- ``sys.setswitchinterval(0.001)``: a thread waiting for the GIL waits about 1 ms per hand-over
  rather than 5 (a planner thread gives it up that much more often; only when one is waiting).
- ``gc.freeze()`` once started: what startup made is left out of later collections (garbage is
  collected first, so none is frozen; frozen objects are still freed by reference counting).
- ``gc.set_threshold(50_000, 20, 100)``: young collections every 50,000 allocations and full
  ones rarely; the planner's tuples hold numbers and are freed by reference counting anyway.
"""

from __future__ import annotations

import gc
import sys

SWITCH_INTERVAL_S = 0.001
GC_THRESHOLDS = (50_000, 20, 100)


def settle_for_serving() -> None:
    """Apply the settings above (once the application has started)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
