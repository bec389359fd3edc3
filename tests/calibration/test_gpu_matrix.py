"""The GPU matrix's bookkeeping, with a stand-in for the GPU: it measures in pieces (resuming
from its file, stopping at a time budget) and its summary counts errors and false fits."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
try:
    import calibration_gpu
finally:
    sys.path.pop(0)

GPU = "H200-141GB"
GIB = 1 << 30


class Card:
    """Measures 2 % above each prediction and runs out of memory above ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.calls: list[str] = []

    def __call__(
        self, model: dict[str, Any], train: dict[str, Any], gpu: str, steps: int
    ) -> dict[str, Any]:
        from headroom import planner

        budget = planner.estimate(
            planner.load_model(model), planner.load_train(train), planner.load_hardware(gpu)
        )
        self.calls.append(json.dumps([model["name"], train], sort_keys=True))
        measured = int(budget.gpu_peak_bytes * 1.02)
        oom = measured > self.capacity
        return {
            "exit_code": 3 if oom else 0,
            "ok": not oom,
            "oom": oom,
            "seconds": 1.0,
            "measured_peak_bytes": min(measured, self.capacity),
        }


def test_the_matrix_resumes_from_its_file_and_summarises(tmp_path: Path) -> None:
    from headroom import planner

    out = tmp_path / "gpu.json"
    design = calibration_gpu.design(GPU)
    total = len(design)
    hw = planner.load_hardware(GPU)
    cliff = [
        planner.estimate(planner.load_model(m), planner.load_train(t), hw)
        for label, m, t in design
        if label.startswith("cliff")
    ]
    # predicted to fit: the verdict's, with its margin
    fitting = sorted(b.gpu_peak_bytes for b in cliff if b.fits)
    refused = len(cliff) - len(fitting)
    assert len(fitting) >= 3 and refused >= 1
    # a card smaller than the planner's: the two highest cliff points predicted to fit
    # measure (2 % above their prediction) past it
    card = Card(capacity=int(1.02 * (fitting[-3] + fitting[-2]) / 2))
    first = calibration_gpu.run_matrix(GPU, out, card, limit=5, log=lambda _: None)
    assert len(card.calls) == 5 and first["measured"] == 5
    summary = calibration_gpu.run_matrix(GPU, out, card, log=lambda _: None)
    assert len(card.calls) == total  # the first five were not run again
    assert len(set(card.calls)) == total
    doc = json.loads(out.read_text())
    assert doc["summary"] == summary
    assert summary["configurations"] == summary["measured"] == total
    assert summary["median_error"] == pytest.approx(0.02 / 1.02, rel=1e-3)
    # the two highest cliff points predicted to fit run out of memory on this card
    rows = [r for r in doc["results"] if r["label"].startswith("cliff")]
    oom_but_fits = [r["label"] for r in rows if r["predicted_fits"] and r["outcome"]["oom"]]
    assert summary["false_fits"] == len(oom_but_fits) == 2
    assert summary["completed"] == total - 2 - refused  # those two and those predicted not to fit


def test_a_time_budget_stops_starting_configurations(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    ticks = iter(range(0, 10_000, 50))  # every clock read advances 50 s
    card = Card(capacity=200 * GIB)
    summary = calibration_gpu.run_matrix(
        GPU, out, card, budget_s=260, log=lambda _: None, clock=lambda: next(ticks)
    )
    # reads: start 0; each configuration reads the clock three times (check, began, end)
    assert len(card.calls) == 2
    assert summary["measured"] == 2 and summary["configurations"] == len(
        calibration_gpu.design(GPU)
    )
    rows = json.loads(out.read_text())["results"]
    assert [("exit_code" in r) for r in rows[:3]] == [True, True, False]
