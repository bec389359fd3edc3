"""The plan's step-time model against published throughput (``calibration/throughput.py``):
its default ``compute_efficiency`` is what the fitting half of Narayanan et al.'s Table 1
gives, the H100's is what its fitting runs give (``calibration/sweep.py``), and the other cases
are held to the errors docs/ESTIMATOR.md reports."""

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
TORCHTITAN = [i for i in IDS if i.startswith("torchtitan-llama3-")]
CASES = {c["id"]: c for c in published()["cases"]}


def test_the_cases_carry_their_sources() -> None:
    assert len(TABLE_1) == 10 and len(PTD_P) == 6 and len(ZERO_3) == 6 and len(TORCHTITAN) == 2
    for c in CASES.values():
        assert c["split"] in ("fit", "held_out") and c["stack"]
        source = c["source"]
        if isinstance(source, str):  # the file's first cases: a paper or a docs page
            assert ("arXiv 2104.04473" in source) != ("torchtitan" in source)
        else:  # a repository file at a commit, and the row that holds the number
            assert source["commit"] in source["url"] and len(source["commit"]) == 40
            tps = f"{c['published_tokens_per_second_per_gpu']:,}".replace(",", "")
            assert tps in source["quote"].replace(",", "")


def test_the_fit_split_is_what_the_file_says() -> None:
    assert {i for i in IDS if CASES[i]["split"] == "fit" and i.startswith("narayanan")} == set(
        FITTED
    )


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


def test_the_h100s_held_out_run_is_within_the_reported_error() -> None:
    """torchtitan's 128-GPU Llama 3.1 8B run on Grand Teton H100s (500 W, HBM2e at 2.4 TB/s),
    held out of the H100's fit: -3.8 % (with the A100's efficiency it was -31 %); its 8-GPU run,
    fitted, -0.8 %."""
    errors = {r.id: r.error for r in replay_all(ids=[i for i in IDS if "-h100-" in i])}
    assert -0.05 <= errors["torchtitan-h100-llama3-8b-fsdp128"] <= 0.0
    assert -0.02 <= errors["torchtitan-h100-llama3-8b-fsdp8"] <= 0.01
    # torch.compile is not a knob of the model: the compiled runs are predicted slower, as
    # uncompiled runs (the fused elementwise work), and reported
    assert 0.10 <= errors["torchtitan-h100-llama3-8b-fsdp128-compile"] <= 0.20


def test_torchtitans_llama2_runs_on_a100s_are_within_the_reported_error() -> None:
    """Held out: torchtitan's Llama 2 13B and 70B on 64 A100s, with and without checkpointing:
    -7.0 ... +8.9 % (docs/ESTIMATOR.md)."""
    errors = [r.error for r in replay_all(ids=[i for i in IDS if "-llama2-" in i])]
    assert len(errors) == 4 and all(-0.08 <= e <= 0.10 for e in errors)
