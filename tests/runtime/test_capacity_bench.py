"""bench/runtime_gpu.py's capacity search, on a CPU under the simulated device cap: the
resident trainer's largest depth by bisection (it runs out of memory one layer deeper), then a
streaming run of four times its parameters under the same cap, each a ``headroom train``
process."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
try:
    import runtime_gpu
finally:
    sys.path.pop(0)


def test_streaming_trains_four_times_what_the_resident_trainer_fits() -> None:
    out = runtime_gpu.capacity(
        1.0, 256, 64, 4.0, host=16 << 30, device="cpu", total=40 << 20, vocab=512
    )
    assert out["reference_layers"] >= 2
    assert out["reference_oom_layers"] == out["reference_layers"] + 1
    assert out["streaming_trained"] is True
    assert out["ratio"] >= 4.0
    assert out["streaming_layers"] >= 4 * out["reference_layers"]
