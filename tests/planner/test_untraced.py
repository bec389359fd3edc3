"""Options a profile's traces never ran are flagged in the budget, naming the field; options a
profile has no term for are refused (``planner.untraced``)."""

from __future__ import annotations

import pytest

from headroom import planner

H100 = planner.gpu("H100-80GB")
GPT = planner.load_model("gpt3-175b").model_copy(update={"num_layers": 8})


def _train(**update: object) -> planner.TrainSpec:
    spec = {"activation_profile": "megatron", "framework": "megatron", "seq_len": 2048}
    return planner.TrainSpec.model_validate({**spec, **update})


def _flags(budget: planner.Budget) -> list[str]:
    return [w for w in budget.warnings if "profile's traces never ran" in w]


def test_a_traced_run_is_not_flagged() -> None:
    budget = planner.estimate(GPT, _train(parallel={"tp": 8, "sequence_parallel": True}), H100)
    assert _flags(budget) == []


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"attention": "eager"}, "attention"),
        ({"parallel": {"cp": 2}}, "parallel.cp"),
        ({"precision": {"params": "fp32", "grads": "fp32"}}, "precision.params"),
    ],
)
def test_an_untraced_option_is_flagged_naming_its_field(
    update: dict[str, object], field: str
) -> None:
    """Priced by the derived terms (the estimate is made), and the budget says which option
    no trace of the profile checked."""
    flagged = planner.estimate(GPT, _train(**update), H100)
    assert _flags(flagged) == [
        w for w in flagged.warnings if w.startswith(f"{field}: the megatron profile's traces")
    ]
    assert len(_flags(flagged)) == 1
    # the textbook is the literature, not a trace: nothing to flag
    textbook = planner.estimate(GPT, _train(activation_profile="textbook", **update), H100)
    assert _flags(textbook) == []


def test_an_mla_model_is_flagged_and_an_moe_model_refused() -> None:
    mla = planner.load_model("tiny-mla")
    dense_mla = mla.model_copy(update={"moe": None})
    flagged = planner.estimate(dense_mla, _train(seq_len=512), H100)
    assert [w.split(":")[0] for w in _flags(flagged)] == ["model.mla"]
    with pytest.raises(planner.SpecError) as err:
        planner.estimate(planner.load_model("tiny-moe"), _train(seq_len=512), H100)
    assert err.value.field == "activation_profile"


def test_the_json_budget_carries_the_flag() -> None:
    budget = planner.estimate(GPT, _train(attention="eager"), H100)
    assert any(w.startswith("attention: ") for w in budget.model_dump()["warnings"])
