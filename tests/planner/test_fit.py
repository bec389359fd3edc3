"""The auto-fit ladder: chosen plans fit, are the fastest fitting candidate, and agree with a
validated estimate of the plan; impossible models are refused with a reason."""

from __future__ import annotations

import planner
from planner.fit import candidates
from planner.steptime import step_time


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
    import importlib

    est = importlib.import_module("planner.estimate")
    best = 0.0
    for kn, _ in candidates(model, train):
        b = planner.evaluate(model, kn, hw, coeffs)
        if b.fits:
            t = step_time(model, kn, hw, coeffs, est._stage_terms(model, kn, coeffs, b.stage))
            best = max(best, t.tokens_per_second)
    assert result.predicted_tokens_per_second == best


def test_every_candidate_matches_its_validated_spec() -> None:
    import importlib

    fit_module = importlib.import_module("planner.fit")
    model = planner.load_model("tiny-moe")
    train = planner.TrainSpec(micro_batch_size=4, parallel={"dp": 2, "ep": 2})
    for kn, changes in candidates(model, train):
        plan = fit_module._plan(train, changes)
        assert planner.knobs(plan) == kn, changes


def test_a_model_that_cannot_fit_anywhere_is_refused_with_a_reason() -> None:
    model = planner.load_model("deepseek-v3")
    hw = planner.load_hardware("RTX-3090", host_memory="64GiB")
    result = planner.fit(model, planner.TrainSpec(), hw)
    assert not result.fits and result.plan is None and result.budget is None
    assert result.candidates_fitting == 0 and result.rejected_total == result.candidates_considered
    assert "no candidate fits" in result.reason
