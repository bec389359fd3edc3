"""The auto-fit ladder: chosen plans fit, are the fastest fitting candidate, and agree with a
validated estimate of the plan; impossible models are refused with a reason."""

from __future__ import annotations

from headroom import planner
from headroom.planner import ladder
from headroom.planner.estimator import stage_terms_from_knobs
from headroom.planner.ladder import candidates
from headroom.planner.steptime import step_time


def test_states_larger_than_the_card_get_offloaded_and_fit() -> None:
    model = planner.load_model("llama-3-8b")
    train = planner.TrainSpec(micro_batch_size=8)
    hw = planner.gpu("H100-80GB")
    assert not planner.estimate(model, train, hw).fits  # 16 B/param alone is 128 GB
    result = planner.fit(model, train, hw)
    assert result.fits and result.plan is not None and result.budget is not None
    plan = planner.TrainSpec.model_validate(result.plan)
    assert plan.offload.mode in ("optimizer", "streaming")
    budget = planner.estimate(model, plan, hw)
    assert budget.fits
    assert budget.model_dump() == result.budget.model_dump()
    # the global batch is kept
    assert plan.micro_batch_size * plan.grad_accum_steps == 8
    assert result.candidates_considered == result.candidates_fitting + result.rejected_total
    assert result.rejected and all(r.reason for r in result.rejected)


def test_the_chosen_plan_is_the_fastest_fitting_candidate() -> None:
    model = planner.load_model("mixtral-8x7b")
    train = planner.TrainSpec(micro_batch_size=4, parallel={"dp": 8, "ep": 8})
    hw = planner.gpu("H100-80GB")
    result = planner.fit(model, train, hw)
    assert result.fits and result.predicted_tokens_per_second is not None
    speeds = [r.tokens_per_second for r in result.runners_up]
    assert all(s is not None and s <= result.predicted_tokens_per_second for s in speeds)
    assert speeds == sorted(speeds, reverse=True)
    # brute force over the same candidates agrees
    coeffs = planner.default_coefficients(train.activation_profile, hw.name)
    best = 0.0
    for kn, _ in candidates(model, train):
        b = planner.evaluate(model, kn, hw, coeffs)
        if b.fits:
            t = step_time(model, kn, hw, coeffs, stage_terms_from_knobs(model, kn, coeffs, b.stage))
            best = max(best, t.tokens_per_second)
    assert result.predicted_tokens_per_second == best


def test_every_candidate_matches_its_validated_spec() -> None:
    model = planner.load_model("tiny-moe")
    train = planner.TrainSpec(micro_batch_size=4, parallel={"dp": 2, "ep": 2})
    for kn, changes in candidates(model, train):
        plan = ladder._plan(train, changes)
        assert planner.knobs(plan) == kn, changes


def test_a_model_that_cannot_fit_anywhere_is_refused_with_a_reason() -> None:
    model = planner.load_model("deepseek-v3")
    hw = planner.load_hardware("RTX-3090", host_memory="64GiB")
    result = planner.fit(model, planner.TrainSpec(), hw)
    assert not result.fits and result.plan is None and result.budget is None
    assert result.candidates_fitting == 0 and result.rejected_total == result.candidates_considered
    assert "no candidate fits" in result.reason


def test_the_search_agrees_with_the_estimate_on_every_candidate() -> None:
    """The search's inlined peak and host checks give the same verdicts as ``evaluate``."""
    model = planner.load_model("llama-3-8b")
    train = planner.TrainSpec(micro_batch_size=2, grad_accum_steps=4, parallel={"dp": 2})
    hw = planner.load_hardware("H100-80GB", host_memory="1TiB", gpus_per_node=2)
    coeffs = planner.default_coefficients(train.activation_profile, hw.name)
    result = planner.fit(model, train, hw, max_listed=10_000)
    all_candidates = candidates(model, train)
    assert result.candidates_considered == len(all_candidates)
    verdicts = [planner.evaluate(model, kn, hw, coeffs) for kn, _ in all_candidates]
    assert result.candidates_fitting == sum(b.fits for b in verdicts)
    rejected_peaks = sorted(r.gpu_peak_bytes for r in result.rejected)
    assert rejected_peaks == sorted(b.gpu_peak_bytes for b in verdicts if not b.fits)
    listed = sorted(r.gpu_peak_bytes for r in result.runners_up)
    fitting = sorted(b.gpu_peak_bytes for b in verdicts if b.fits)
    assert set(listed) <= set(fitting)


def test_the_grid_keeps_the_global_batch_and_spans_every_dimension() -> None:
    model = planner.load_model("llama-3-8b")  # 32 layers
    train = planner.TrainSpec(micro_batch_size=4, grad_accum_steps=8, parallel={"dp": 4})
    g = ladder.grid(model, train)
    shapes = [(keys["micro_batch_size"], keys["grad_accum_steps"]) for _, keys, _ in g.micro]
    assert shapes == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]
    assert [keys["recompute"] for _, keys, _ in g.recompute] == [
        "none",
        "selective",
        {"every_k": 16},
        {"every_k": 8},
        {"every_k": 4},
        {"every_k": 2},
        "full",
    ]
    modes = [keys["offload"]["mode"] for _, keys, _ in g.placements]
    assert modes.count("optimizer") == 8 and modes.count("streaming") == 5
    assert [keys["parallel.zero_stage"] for _, keys, _ in g.zeros] == [0, 1, 2, 3]
    # the input configuration is a candidate, marked unchanged in every dimension
    unchanged = [sum(not c[2] for c in dim) for dim in g]
    assert unchanged == [1, 1, 1, 1, 1]


def test_excluded_candidates_are_not_chosen_again() -> None:
    model = planner.load_model("llama-3-8b")
    train = planner.TrainSpec(micro_batch_size=8)
    hw = planner.gpu("H100-80GB")
    first = planner.fit(model, train, hw)
    assert first.plan is not None
    tried = {
        ladder.candidate_key(keys)
        for kn, keys in candidates(model, train)
        if planner.knobs(planner.TrainSpec.model_validate(first.plan)) == kn
    }
    assert len(tried) == 1
    second = planner.fit(model, train, hw, exclude=tried)
    assert second.excluded == 1 and second.plan != first.plan
    assert second.candidates_fitting == first.candidates_fitting - 1
    assert second.predicted_tokens_per_second is not None
    assert first.predicted_tokens_per_second is not None
    assert second.predicted_tokens_per_second <= first.predicted_tokens_per_second
