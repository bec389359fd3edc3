"""``headroom calibrate fit`` from the store and the trust rule behind ``--calibrated``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from headroom import planner
from headroom.calibration.refit import committed_records
from headroom.calibration.trust import assess

RUNTIME_BF16 = [
    "--set",
    "activation_profile=runtime",
    "--set",
    "precision.master=none",
    "--set",
    "precision.grads=bf16",
    "--set",
    "precision.optimizer_states=bf16",
]


@pytest.mark.parametrize(
    ("errors", "trusted", "margin"),
    [
        ([0.01, -0.02, 0.03], True, 0.02),  # within 5 %: the margin covers the worst miss
        ([0.01, 0.0, 0.049, -0.001], True, 0.001),
        ([-0.08, 0.01, 0.0], False, 0.13),  # an 8 % under-prediction: 8 % + 5 %
        # over-predictions are safe but not within 5 %: the default margin, which the
        # published GPU runs support (6 %)
        ([0.09, 0.08, 0.10], False, 0.06),
        ([0.01, 0.02], False, 0.06),  # too few to trust
        ([], False, 0.06),  # nothing measured here
        ([-0.9, -0.2, 0.0], False, 0.5),  # capped: past it a plan needs measuring
    ],
)
def test_the_trust_rule(errors: list[float], trusted: bool, margin: float) -> None:
    base = planner.default_coefficients("runtime")
    out = assess(base, errors)
    assert out.trusted is trusted
    assert out.margin_fraction == pytest.approx(margin)
    assert out.recent_records == len(errors)
    under = min([0.0, *errors])
    assert out.observed_error == (pytest.approx(under) if errors else None)
    # the estimate reports what it used, and the verdict includes the margin
    model, train = planner.load_model("llama-3-8b"), planner.TrainSpec(activation_profile="runtime")
    budget = planner.estimate(model, train, planner.gpu("H100-80GB"), out)
    used = budget.coefficients
    assert (used.trusted, used.margin_fraction, used.recent_records) == (
        trusted,
        out.margin_fraction,
        len(errors),
    )
    assert budget.margin_bytes == pytest.approx(budget.gpu_peak_bytes * margin, abs=1)


def _estimate(cli: Any) -> dict[str, Any]:
    result = cli("estimate", "tiny-dense", *RUNTIME_BF16, "--calibrated", "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["coefficients"]  # type: ignore[no-any-return]


def test_calibrated_estimates_earn_trust_from_recorded_traces_and_use_refits(cli: Any) -> None:
    fresh = _estimate(cli)
    assert fresh["calibrated"] and fresh["trusted"] is False and fresh["recent_records"] == 0
    # nothing measured here yet: the default margin the published GPU runs support
    assert fresh["margin_fraction"] == pytest.approx(planner.DEFAULT_MARGIN_FRACTION)
    for seq in (32, 64, 96):
        result = cli(
            "calibrate",
            "trace",
            "tiny-dense",
            *RUNTIME_BF16,
            "--set",
            f"seq_len={seq}",
            "--record",
            "--format",
            "json",
        )
        assert result.exit_code == 0, result.output
        assert abs(json.loads(result.stdout)["error"]["total"]) < 0.05
    earned = _estimate(cli)
    assert earned["trusted"] is True and earned["recent_records"] == 3
    assert earned["margin_fraction"] < 0.05
    # the evidence is the (implementation, framework) pair's: the same model code under
    # DeepSpeed has no records yet
    result = cli(
        "estimate", "tiny-dense", *RUNTIME_BF16, "--set", "framework=deepspeed",
        "--set", "parallel.dp=2", "--set", "parallel.zero_stage=1",
        "--calibrated", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    other = json.loads(result.stdout)["coefficients"]
    assert other["trusted"] is False and other["recent_records"] == 0
    from headroom.store import Calibration, open_store

    with open_store()() as session:
        from sqlalchemy import select

        assert {r.framework for r in session.scalars(select(Calibration))} == {"none"}

    result = cli("calibrate", "fit", "--profile", "runtime", "--format", "json")
    assert result.exit_code == 0, result.output
    (fitted,) = json.loads(result.stdout)["fitted"]
    committed = len(committed_records("runtime"))
    assert committed >= 16 and fitted["traces"] == {"committed": committed, "stored": 3}
    assert fitted["peak_error"]["max"] <= 0.02
    assert [s["device"] for s in fitted["stored"]] == [None]
    used = _estimate(cli)
    assert used["source"].startswith(
        f"headroom calibrate fit: activation terms from {committed} committed"
    )
    assert used["trusted"] is True

    # a second refit supersedes the first; both stay in the store
    assert cli("calibrate", "fit", "--profile", "runtime").exit_code == 0
    from sqlalchemy import select

    from headroom.store import CoefficientSet, open_store

    with open_store()() as session:
        rows = list(session.scalars(select(CoefficientSet).order_by(CoefficientSet.id)))
    assert [r.active for r in rows] == [False, True]


def test_gpu_records_with_reserved_bytes_fit_a_device_set(cli: Any) -> None:
    from headroom import planner
    from headroom.calibration.stored import record_measurement
    from headroom.planner.measurement import Measurement
    from headroom.store import open_store

    model = planner.load_model("tiny-dense")
    train = planner.load_train({"activation_profile": "runtime"})
    hw = planner.load_hardware("H200-141GB")
    before = cli("estimate", "tiny-dense", "--gpu", "H200-141GB", *RUNTIME_BF16, "--format", "json")
    with open_store()() as session:
        for allocated, reserved, context in [(100, 110, 500), (200, 230, 530), (400, 420, None)]:
            measured = Measurement(
                allocated_bytes=allocated * 2**20,
                reserved_bytes=reserved * 2**20,
                buckets=None if context is None else {"cuda_context": context * 2**20},
            )
            record_measurement(
                session=session,
                uid=f"gpu-{allocated}",
                model=model,
                train=train,
                hw=hw,
                measured=measured,
                source="runtime",
            )
    result = cli("calibrate", "fit", "--profile", "runtime", "--format", "json")
    assert result.exit_code == 0, result.output
    (fitted,) = json.loads(result.stdout)["fitted"]
    assert [s["device"] for s in fitted["stored"]] == [None, "H200-141GB"]
    assert fitted["allocator_overhead"]["H200-141GB"] == {"fraction": 0.1, "records": 3}
    # the largest context measured: every run pays it whole
    assert fitted["cuda_context"]["H200-141GB"] == {"bytes": 530 * 2**20, "records": 2}
    text = cli("calibrate", "fit", "--profile", "runtime")
    assert "H200-141GB: allocator overhead 10.00% (3 runs), CUDA context 530" in text.stdout
    result = cli(
        "estimate",
        "tiny-dense",
        "--gpu",
        "H200-141GB",
        *RUNTIME_BF16,
        "--calibrated",
        "--format",
        "json",
    )
    used = json.loads(result.stdout)["coefficients"]
    assert used["device"] == "H200-141GB" and used["recent_records"] == 3
    # the fitted context replaces the GPU preset's (1 GiB) in the estimate
    assert json.loads(result.stdout)["gpu"]["buckets"]["cuda_context"] == 530 * 2**20
    assert json.loads(before.stdout)["gpu"]["buckets"]["cuda_context"] == 2**30


def test_calibrate_fit_refuses_what_it_cannot_fit(cli: Any) -> None:
    bad = cli("calibrate", "fit", "--profile", "bogus")
    assert bad.exit_code == 2 and "--profile" in bad.output and "runtime" in bad.output
    empty = cli("calibrate", "fit", "--profile", "textbook", "--no-committed", "--format", "json")
    assert empty.exit_code == 1
    (skipped,) = json.loads(empty.stdout)["skipped"]
    assert skipped["profile"] == "textbook" and "at least 3" in skipped["reason"]


def test_calibrate_run_refuses_without_a_gpu_naming_the_flag(cli: Any) -> None:
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real path
        pytest.skip("this machine has a CUDA device: the refusal is for machines without one")
    missing = cli("calibrate", "run", "tiny-dense")
    assert missing.exit_code == 2 and "--gpu-probe" in missing.output
    no_gpu = cli("calibrate", "run", "tiny-dense", "--gpu-probe")
    assert no_gpu.exit_code == 2 and "no CUDA device" in no_gpu.output
    bad = cli("calibrate", "run", "gpt3-175b", "--gpu-probe")
    assert bad.exit_code == 2 and "model.dropout" in bad.output
