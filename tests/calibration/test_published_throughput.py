"""The plan's step-time model against published throughput (``calibration/throughput.py``):
its default ``compute_efficiency`` is what the fitting half of Narayanan et al.'s Table 1
gives, and the other cases are held to the errors docs/ESTIMATOR.md reports."""

from __future__ import annotations

import statistics

import pytest

from headroom import planner
from headroom.calibration.throughput import fit_efficiency, published, replay_all

IDS = [c["id"] for c in published()["cases"]]
TABLE_1 = [i for i in IDS if "-t1-" in i]
FITTED = TABLE_1[0::2]
PTD_P = [i for i in IDS if "-ptdp-" in i]
ZERO_3 = [i for i in IDS if "-zero3-" in i]
TORCHTITAN = [i for i in IDS if i.startswith("torchtitan-")]


def test_the_cases_carry_their_sources() -> None:
    doc = published()
    assert len(TABLE_1) == 10 and len(PTD_P) == 6 and len(ZERO_3) == 6 and len(TORCHTITAN) == 2
    for c in doc["cases"]:
        assert ("arXiv 2104.04473" in c["source"]) != ("torchtitan" in c["source"])


def test_the_default_efficiency_is_the_fit_to_half_of_table_1() -> None:
    fitted = fit_efficiency(FITTED)
    assert fitted == pytest.approx(planner.Coefficients(profile="x").compute_efficiency, abs=5e-3)


def test_held_out_megatron_runs_are_within_the_reported_error() -> None:
    errors = {r.id: r.error for r in replay_all()}
    held = [errors[i] for i in TABLE_1 + PTD_P if i not in FITTED]
    assert len(held) == 11
    # reported in docs/ESTIMATOR.md: -5.0 ... +1.2 %, median |error| 1.2 %
    assert min(held) >= -0.055 and max(held) <= 0.02
    assert statistics.median(abs(e) for e in held) <= 0.02
    fitted = [errors[i] for i in FITTED]
    assert max(abs(e) for e in fitted) <= 0.04


def test_zero_3_at_scale_is_under_predicted_as_documented() -> None:
    """The model prices bandwidth-optimal gathers overlapped with compute (FSDP2's); the
    published ZeRO-3 runs (DeepSpeed, 2021) were communication-bound, more so with more GPUs:
    the gap is reported, not fitted away."""
    errors = {r.id: r.error for r in replay_all()}
    z = [errors[i] for i in ZERO_3]
    assert all(e < 0 for e in z)
    assert errors["narayanan-t2-zero3-175b-1536"] < errors["narayanan-t2-zero3-175b-384"] < 0


def test_torchtitans_fsdp2_runs_are_within_the_reported_error() -> None:
    """FSDP2 over 64 A100s (Llama 3 8B with per-op selective checkpointing, 70B with full):
    reported in docs/ESTIMATOR.md as +2.3 % and +7.7 % (the 8B run priced as selective, which
    recomputes only the attention core, was -6.6 %)."""
    errors = {r.id: r.error for r in replay_all(ids=TORCHTITAN)}
    assert 0.01 <= errors["torchtitan-llama3-8b-sac-op"] <= 0.035
    assert 0.06 <= errors["torchtitan-llama3-70b-full"] <= 0.09
