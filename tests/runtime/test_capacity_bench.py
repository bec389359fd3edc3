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
        1.0, 128, 64, 4.0, host=16 << 30, device="cpu", total=10 << 20, vocab=512
    )
    assert out["reference_layers"] >= 2
    assert out["reference_oom_layers"] == out["reference_layers"] + 1
    assert out["streaming_trained"] is True
    assert out["ratio"] >= 4.0
    assert out["streaming_layers"] >= 4 * out["reference_layers"]


def test_the_steps_section_runs_every_schedule() -> None:
    """The ``steps`` section end to end on a CPU (its timings mean nothing here): the bound's
    parts, and the clipped, unclipped and unprefetched streaming runs beside it."""
    rows = [{"size_mib": 1, "pinned": True, "h2d_gb_s": 10.0, "d2h_gb_s": 10.0}]
    out = runtime_gpu.steps_vs_bound(4, 128, 32, rows, 1e8, host=16 << 30, device="cpu", vocab=256)
    parts = out["bound_parts"]
    assert out["bound_seconds"] == max(parts["compute"], parts["transfer"], parts["cpu_optimizer"])
    for label in ("prefetch", "prefetch_unclipped", "no_prefetch"):
        run = out[label]
        assert run["step_seconds"] > 0
        assert run["ratio_to_bound"] == run["step_seconds"] / out["bound_seconds"]
        assert run["expected_seconds"] >= out["bound_seconds"]


def test_the_landing_measure_lands_both_ways() -> None:
    out = runtime_gpu.landing(1 << 12)
    assert set(out) == {"first_landing_per_s", "later_landing_per_s"}
    assert all(rate > 0 for rate in out.values())


def test_the_routing_scale_measure_times_both_ways() -> None:
    out = runtime_gpu.routing_scale(3, 5, 16, repeats=1)
    assert out["eager_seconds"] > 0 and out["slabs_seconds"] > 0
    assert "eager_peak_bytes" not in out  # no device counters on a CPU, none invented


def test_the_ranks_section_runs_dp_ranks_and_holds_the_node_to_the_host_budget() -> None:
    """The ``ranks`` section on a CPU (gloo; its timings mean nothing here): one and two
    data-parallel streaming ranks of this node, each run's step and scaling, and the host RAM
    the node's ranks pinned against the planner's host budget for them (within alignment)."""
    rows = [{"size_mib": 1, "pinned": True, "h2d_gb_s": 10.0, "d2h_gb_s": 10.0}]
    out = runtime_gpu.ranks_vs_bound(
        2, 128, 16, [1, 2], rows, 1e8, host=16 << 30, device="cpu", vocab=256, steps=2
    )
    assert set(out["runs"]) == {1, 2}
    assert out["runs"][1]["scaling"] == 1.0
    for ranks, run in out["runs"].items():
        assert run["step_seconds"] > 0 and run["ranks_sharing"] == ranks
        # the trainer's ranks pin what the planner budgets for the node, less than 1 % apart
        assert abs(run["host_ratio"] - 1) < 0.01, run
