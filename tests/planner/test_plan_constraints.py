"""The layout keys a plan's training spec names are constraints: the search keeps to them,
counts only what meets them, says which applied, and refuses one no layout can meet naming
its key and why; a framework's own ZeRO stages are searched without a zero_stage by hand.

``--set parallel.tp=8`` was ignored (the plan searched every TP, its answer tp 1), and
``--set framework=fsdp2`` (or deepspeed) failed on the default ZeRO stage 0.
"""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner
from headroom.planner.cluster import cluster_for_gpu
from headroom.planner.constraints import LAYOUT_KEYS, PlanConstraints, split_plan_train
from headroom.planner.layout import Planner, PlanResult


def _planner(
    model: str,
    train: dict[str, Any] | None,
    gpus: int = 16,
    batch: int = 64,
    seq: int = 4096,
    gpu: str = "H100-80GB",
) -> Planner:
    cl = cluster_for_gpu(planner.gpu(gpu))
    spec, constraints = split_plan_train(train)
    return Planner(
        planner.load_model(model),
        spec,
        cl,
        cl.hardware(),
        gpus,
        batch,
        seq,
        constraints=constraints,
    )


def _value(spec: dict[str, Any], key: str) -> Any:
    section, _, leaf = key.rpartition(".")
    return (spec[section] if section else spec)[leaf]


def _listed(result: PlanResult) -> list[dict[str, Any]]:
    """The chosen plan's and every runner-up's training spec."""
    assert result.plan is not None
    return [result.plan, *(c.plan for c in result.runners_up if c.plan is not None)]


#: (model, a layout key's constraint): each one a plan of 16 H100s can meet
CONSTRAINED = [
    ("llama-3-8b", {"parallel": {"tp": 8}}),
    ("llama-3-8b", {"parallel": {"pp": 2}}),
    ("llama-3-8b", {"parallel": {"vpp": 2}}),
    ("llama-3-8b", {"parallel": {"cp": 2}}),
    ("llama-3-8b", {"parallel": {"dp": 4}}),
    ("mixtral-8x7b", {"parallel": {"ep": 4}}),
    ("llama-3-8b", {"parallel": {"zero_stage": 1}}),
    ("llama-3-8b", {"parallel": {"tp": 4, "sequence_parallel": False}}),
    ("llama-3-8b", {"micro_batch_size": 2}),
    ("llama-3-8b", {"grad_accum_steps": 8}),
    ("llama-3-8b", {"recompute": "full"}),
    ("llama-3-8b", {"recompute": {"every_k": 2}}),
    ("llama-3-8b", {"offload": {"mode": "optimizer", "fraction": 0.3}}),
    ("llama-3-8b", {"offload": {"mode": "streaming", "checkpoint_every": 2}}),
    ("llama-3-8b", {"expandable_segments": False}),
]


@pytest.mark.parametrize(("model", "train"), CONSTRAINED)
def test_a_named_layout_key_narrows_the_search_to_its_value(
    model: str, train: dict[str, Any]
) -> None:
    p = _planner(model, train)
    free = _planner(model, None)
    # counted as made: fewer layouts and candidates, every one of them meeting it
    size = p.size()
    lays = p.layouts()
    groups: list[Any] = []
    rejected = {"model_states": 0}
    priced = p.candidates(lays, groups, rejected)
    assert size.layouts == len(lays) > 0
    assert size.candidates == len(priced) + rejected["model_states"]
    assert p.count(lays) == (size.groups, size.candidates)
    if "expandable_segments" in train:  # tried inside a candidate's estimate: not counted
        assert p.segments == (False,) and free.segments == (False, True)
    else:
        assert size.candidates < free.size().candidates
    given = split_plan_train(train)[1].given()
    assert given and set(given) <= set(LAYOUT_KEYS)
    result = p.run(max_listed=4)
    assert result.fits, result.reason
    assert result.constraints == given
    assert "with " + ", ".join(f"{k}={v}" for k, v in given.items()) in result.reason
    for spec in _listed(result):
        for key, value in given.items():
            assert _value(spec, key) == value, (key, spec)
        # a valid spec of that layout, whose estimate is the plan's
        planner.estimate(p.model, planner.TrainSpec.model_validate(spec), p.hw, p.coeffs)


def test_tp_8_is_kept_where_the_plan_would_choose_another() -> None:
    free = _planner("llama-3-70b", None, gpus=64, batch=512, seq=8192).run()
    assert free.plan is not None and free.plan["parallel"]["tp"] != 8
    kept = _planner("llama-3-70b", {"parallel": {"tp": 8}}, gpus=64, batch=512, seq=8192).run()
    assert {spec["parallel"]["tp"] for spec in _listed(kept)} == {8}
    assert kept.constraints == {"parallel.tp": 8} and kept.layouts_considered > 1


@pytest.mark.parametrize(
    ("model", "train", "field", "why"),
    [
        ("llama-3-70b", {"parallel": {"tp": 3}}, "train.parallel.tp", "must divide num_heads"),
        ("llama-3-8b", {"parallel": {"tp": 16}}, "train.parallel.tp", "num_kv_heads (8)"),
        ("llama-3-70b", {"parallel": {"pp": 81}}, "train.parallel.pp", "num_layers (80)"),
        ("llama-3-70b", {"parallel": {"vpp": 3}}, "train.parallel.vpp", "pp x vpp equal"),
        (
            "llama-3-70b",
            {"parallel": {"pp": 4, "vpp": 3}},
            "train.parallel.vpp",
            "equal chunks",
        ),
        ("llama-3-70b", {"parallel": {"cp": 3}}, "train.parallel.cp", "2 x cp"),
        ("mixtral-8x7b", {"parallel": {"ep": 3}}, "train.parallel.ep", "moe.num_experts (8)"),
        ("llama-3-70b", {"parallel": {"ep": 2}}, "train.parallel.ep", "no experts"),
        ("llama-3-70b", {"parallel": {"dp": 5}}, "train.parallel.dp", "global batch (512"),
        ("llama-3-70b", {"micro_batch_size": 3}, "train.micro_batch_size", "global batch"),
        ("llama-3-70b", {"parallel": {"dp": 128}}, "train.parallel.dp", "at most 64 GPUs"),
        (
            "llama-3-70b",
            {"framework": "megatron", "parallel": {"pp": 3}},
            "train.parallel.pp",
            "Megatron splits num_layers (80) evenly",
        ),
        (
            "llama-3-70b",
            {"framework": "deepspeed", "parallel": {"vpp": 2}},
            "train.parallel.vpp",
            "1F1B only",
        ),
        (
            "llama-3-70b",
            {"framework": "deepspeed", "parallel": {"pp": 2, "zero_stage": 3}},
            "train.parallel.pp",
            "ZeRO stage 1 at most",
        ),
        (
            "llama-3-70b",
            {"framework": "fsdp2", "parallel": {"zero_stage": 1}},
            "parallel.zero_stage",
            "allowed: 3",
        ),
        (
            "llama-3-70b",
            {"framework": "megatron", "offload": {"mode": "streaming"}},
            "offload.mode",
            "allowed: none, optimizer",
        ),
        (
            "llama-3-70b",
            {"parallel": {"tp": 8}, "offload": {"mode": "streaming"}},
            "train.offload.mode",
            "parallel.tp=1",
        ),
        (
            "llama-3-70b",
            {"offload": {"mode": "none", "fraction": 0.5}},
            "train.offload.fraction",
            "offload.mode optimizer only",
        ),
        (
            "llama-3-70b",
            {"framework": "megatron", "offload": {"checkpoint_every": 2}},
            "offload.mode",
            "allowed: none, optimizer, got streaming",
        ),
        ("llama-3-70b", {"parallel": {"tp": "eight"}}, "train.parallel.tp", "integer"),
        ("llama-3-70b", {"parallel": {"vpp": True}}, "train.parallel.vpp", "not a boolean"),
        ("llama-3-70b", {"recompute": "most"}, "train.recompute", "'none'"),
    ],
)
def test_a_constraint_no_layout_can_meet_is_refused_naming_its_key(
    model: str, train: dict[str, Any], field: str, why: str
) -> None:
    with pytest.raises(planner.SpecError) as err:
        _planner(model, train, gpus=64, batch=512, seq=8192).run()
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(f"{field}:") and why in str(err.value), str(err.value)


def test_constraints_no_layout_meets_together_are_refused_naming_them() -> None:
    train = {"parallel": {"tp": 8, "pp": 8, "dp": 4}}  # 256 GPUs of 64
    with pytest.raises(planner.SpecError) as err:
        _planner("llama-3-70b", train, gpus=64, batch=512, seq=8192).run()
    assert err.value.field == "train"
    assert "no layout of at most 64 GPUs" in str(err.value)
    assert "parallel.tp=8, parallel.pp=8, parallel.dp=4" in str(err.value)
    with pytest.raises(planner.SpecError) as err:
        train = {"micro_batch_size": 4, "grad_accum_steps": 256}  # a batch of 1,024 on dp 1
        _planner("llama-3-70b", train, gpus=64, batch=512, seq=8192).run()
    assert err.value.field == "train"
    # one constraint: named as the field (one micro-batch a step: none the pipeline divides)
    with pytest.raises(planner.SpecError) as err:
        _planner("llama-3-70b", {"parallel": {"vpp": 2}}, gpus=64, batch=1, seq=8192).run()
    assert err.value.field == "train.parallel.vpp"
    assert "meets parallel.vpp=2 with a global batch of 1" in str(err.value)


def test_constraints_that_fit_nothing_are_a_plan_that_does_not_fit() -> None:
    train = {"parallel": {"tp": 1, "pp": 1}, "offload": {"mode": "none"}}
    result = _planner("llama-3-70b", train, gpus=8, batch=64, seq=8192).run()
    assert not result.fits and result.layouts_considered > 0
    assert "with parallel.tp=1, parallel.pp=1, offload.mode=none fits" in result.reason


def test_a_key_given_alone_is_a_constraint_not_a_spec_refused() -> None:
    """``parallel.vpp`` without ``parallel.pp`` (the spec's default pp 1 refuses it) and
    ``parallel.ep`` without ``parallel.dp`` are constraints; the rest is the spec's."""
    spec, constraints = split_plan_train(
        {"parallel": {"vpp": 2, "ep": 4}, "framework": "deepspeed", "offload": {"num_buffers": 3}}
    )
    assert constraints == PlanConstraints(vpp=2, ep=4)
    assert spec.framework == "deepspeed" and spec.offload.num_buffers == 3
    with pytest.raises(planner.SpecError) as err:
        split_plan_train({"parallel": {"tp": 2, "bogus": 1}})
    assert err.value.field == "train.parallel.bogus"


@pytest.mark.parametrize(
    ("framework", "stages", "named"),
    [
        ("fsdp2", {3}, "fsdp2 shards parameters"),
        ("deepspeed", {1, 2, 3}, "DeepSpeed"),
        ("megatron", {0}, "distributed_optimizer"),
        ("none", {0, 1, 2, 3}, "framework none"),
    ],
)
def test_the_framework_chooses_its_zero_stages(
    framework: str, stages: set[int], named: str
) -> None:
    p = _planner("llama-3-70b", {"framework": framework}, gpus=64, batch=512, seq=8192)
    result = p.run()
    assert result.fits, result.reason
    assert set(result.zero_stages) == stages and named in result.zero_stages_reason
    chosen = {spec["parallel"]["zero_stage"] for spec in _listed(result)}
    assert chosen <= stages
    for lay in p.layouts():
        zeros = set(p.zeros(lay.pp, lay.dp * lay.cp > 1))
        assert zeros <= stages
        if framework == "deepspeed" and lay.pp > 1:
            assert zeros == {1}
    for spec in _listed(result):
        assert spec["framework"] == framework
        planner.estimate(p.model, planner.TrainSpec.model_validate(spec), p.hw, p.coeffs)
