"""The state precisions and EMA placements on the simulated device: 16-bit moments, fp32
gradient accumulation, the EMA on the device or the host and pure bf16 each hold, under every
placement they allow, what the planner predicts for the spec (the trainer keeps the spec's
state, and the planner counts it)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def rows(calibration_sim: ModuleType) -> list[dict[str, Any]]:
    return [
        {"label": label, "mode": train["offload"]["mode"], **calibration_sim.measure(model, train)}
        for label, model, train in calibration_sim.state_design(width=128, seq_len=128)
    ]


def test_the_design_covers_every_variant_and_placement(
    rows: list[dict[str, Any]], calibration_sim: ModuleType
) -> None:
    for name, _ in calibration_sim.STATE_VARIANTS:
        modes = {r["mode"] for r in rows if f" {name} " in r["label"]}
        assert modes == ({"none"} if name == "pure-bf16" else {"none", "optimizer", "streaming"})
    assert any("tied" in r["label"] and "accum 2" in r["label"] for r in rows)


def test_resident_state_is_the_planners_to_half_a_percent(rows: list[dict[str, Any]]) -> None:
    """Resident and optimizer-offload runs: the peak and the optimizer phase (where the moments,
    the accumulator, the EMA and the update's scratch all live) within 0.5 %."""
    for r in rows:
        if r["mode"] == "streaming":
            continue
        assert abs(r["error"]) <= 0.005, r
        measured, predicted = r["measured_optimizer_bytes"], r["predicted_optimizer_bytes"]
        assert abs(measured / predicted - 1) <= 0.005, r


def test_streaming_state_stays_on_the_host(rows: list[dict[str, Any]]) -> None:
    """Streaming keeps every state on the host: the variants change nothing on the device (the
    fp32 accumulator is the host's), and the peak is the planner's within 1 % (the loss runs on
    the head's pool buffer)."""
    for model in {r["label"].split()[0] for r in rows}:
        streaming = [r for r in rows if r["mode"] == "streaming" and r["label"].split()[0] == model]
        assert len({r["measured_peak_bytes"] for r in streaming}) == 1, streaming
        assert len({r["predicted_peak_bytes"] for r in streaming}) == 1, streaming
        assert all(abs(r["error"]) <= 0.01 for r in streaming), streaming
