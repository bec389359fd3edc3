"""The runtime profile fitted to CPU traces: held-out accuracy, the shipped set reproduced from
the committed records, the records reproduced by tracing again, and ``--calibrated``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import planner
from calibration.fit import FITTED, fit_coefficients, peak_errors, shipped_entry
from calibration.trace import trace

RECORDS = Path(__file__).resolve().parents[2] / "calibration" / "data" / "runtime-traces.json"


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return json.loads(RECORDS.read_text())["records"]  # type: ignore[no-any-return]


def test_the_fit_predicts_held_out_traces_within_two_percent(
    records: list[dict[str, Any]],
) -> None:
    fit = [r for r in records if not r["held_out"]]
    held_out = [r for r in records if r["held_out"]]
    assert len(held_out) >= 8 and any(r["model"]["moe"] for r in held_out)
    coeffs = fit_coefficients(fit)
    errors = peak_errors(held_out, coeffs)
    assert max(abs(e) for e in errors) <= 0.02, errors
    assert max(abs(e) for e in peak_errors(fit, coeffs)) <= 0.02
    # the textbook profile is far off the trainer: the fit is what makes the difference
    textbook = planner.default_coefficients("textbook")
    assert max(abs(e) for e in peak_errors(held_out, textbook)) > 0.1


def test_sequence_lengths_and_sizes_outside_the_fit_are_predicted(
    records: list[dict[str, Any]],
) -> None:
    """Fit on the short sequences only and predict the longest (the held-out axis is the
    sequence length, not a random split)."""
    short = [r for r in records if r["train"]["seq_len"] < 128]
    long = [r for r in records if r["train"]["seq_len"] == 128]
    coeffs = fit_coefficients(short)
    assert max(abs(e) for e in peak_errors(long, coeffs)) <= 0.02


def test_the_shipped_runtime_coefficients_are_the_fit_of_the_committed_records(
    records: list[dict[str, Any]],
) -> None:
    shipped = planner.default_coefficients("runtime")
    assert shipped.calibrated and shipped.num_records == sum(not r["held_out"] for r in records)
    entry = shipped_entry("runtime")
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("index", [0, 19])  # one dense (fake tensors), one MoE (real)
def test_committed_records_are_what_tracing_gives_today(
    records: list[dict[str, Any]], index: int
) -> None:
    record = records[index]
    model = planner.ModelSpec.model_validate(record["model"])
    train = planner.TrainSpec.model_validate(record["train"])
    measured = trace(model, train)
    assert measured["mode"] == record["mode"]
    assert measured["peak"] == record["peak"]


def test_estimate_calibrated() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "headroom", "estimate", "tiny-dense", "--calibrated", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    refused = run()
    assert refused.returncode == 3
    assert "no calibrated coefficients for profile 'textbook'" in refused.stderr
    ok = run("--set", "activation_profile=runtime", "--format", "json")
    assert ok.returncode == 0, ok.stderr
    coefficients = json.loads(ok.stdout)["coefficients"]
    assert coefficients["calibrated"] is True and coefficients["profile"] == "runtime"
