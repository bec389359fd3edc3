"""The GPU matrix's grid on the simulated device: the trainer's allocated peak in every
placement and recompute policy, dense and MoE, is the planner's (the GPU targets: every
configuration within 3 %, median within 1.5 %), and the optimizer phase holds what the
planner says it holds."""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def rows(calibration_sim: ModuleType) -> list[dict[str, Any]]:
    return [
        {"label": label, "mode": train["offload"]["mode"], **calibration_sim.measure(model, train)}
        for label, model, train in calibration_sim.design(width=128, seq_div=16)
    ]


def test_the_grid_covers_the_gpu_matrix(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == 26
    assert {r["mode"] for r in rows} == {"none", "optimizer", "streaming"}
    assert any("moe" in r["label"] for r in rows) and any("full" in r["label"] for r in rows)


def test_every_peak_is_the_planners_within_the_gpu_targets(rows: list[dict[str, Any]]) -> None:
    errors = {r["label"]: r["error"] for r in rows}
    assert max(abs(e) for e in errors.values()) <= 0.03, errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.015, errors
    # without the CUDA allocator the simulated device leaves the estimate more to answer for:
    # every policy and placement within 1.5 % (0.77 % at worst when last measured)
    assert max(abs(e) for e in errors.values()) <= 0.015, errors


def test_the_optimizer_phase_holds_what_the_planner_counts(rows: list[dict[str, Any]]) -> None:
    """No optimizer temporaries beyond the planner's (streaming's phase window opens while the
    last micro-batch's tensors are still being released, so it is left out)."""
    for r in rows:
        if r["mode"] != "streaming":
            measured, predicted = r["measured_optimizer_bytes"], r["predicted_optimizer_bytes"]
            assert abs(measured / predicted - 1) <= 0.01, r
