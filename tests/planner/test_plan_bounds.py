"""Specs the planner cannot honour are refused, and the ladder never proposes one.

The ladder keeps the global batch per rank and walks power-of-two micro-batches; with a batch of
2^31 (2^30 steps of 2) the micro-batch of 1 needed 2^31 steps, beyond ``grad_accum_steps``'s
bound, and validating the chosen plan raised a raw pydantic error (a 500 and a traceback).
"""

from __future__ import annotations

from headroom import planner
from headroom.planner import ladder

HUGE_ACCUM = planner.TrainSpec(micro_batch_size=2, grad_accum_steps=2**30)


def test_ladder_candidates_stay_within_the_training_spec_bounds() -> None:
    model = planner.load_model("llama-3-8b")
    shapes = set()
    for kn, changes in ladder.candidates(model, HUGE_ACCUM):
        plan = ladder._plan(HUGE_ACCUM, changes)  # validates every bound
        assert plan.micro_batch_size * plan.grad_accum_steps == 2**31
        assert planner.knobs(plan) == kn
        shapes.add((plan.micro_batch_size, plan.grad_accum_steps))
    assert (2, 2**30) in shapes and (1, 2**31) not in shapes


def test_fit_with_the_largest_accumulation_returns_a_valid_plan() -> None:
    model = planner.load_model("llama-3-8b")
    result = planner.fit(model, HUGE_ACCUM, planner.gpu("H100-80GB"))
    assert result.fits and result.plan is not None
    plan = planner.TrainSpec.model_validate(result.plan)
    assert plan.grad_accum_steps <= 2**30
    assert plan.micro_batch_size * plan.grad_accum_steps == 2**31
    for considered in (*result.runners_up, *result.rejected):
        assert considered.changes.get("grad_accum_steps", 0) <= 2**30
