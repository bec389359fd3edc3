"""Layouts the estimator cannot split the model by are refused, naming the field and the
degrees that would work; booleans are not numbers.

The estimator rounds each TP shard up, gives empty pipeline stages nothing and each EP rank a
ceiling share of the experts, so tp 3 on 32 heads, pp 64 on 32 layers or ep 3 on 8 experts were
estimated as if they could run (no warning). A JSON ``true`` was read as 1 wherever a count or a
size was expected (a 1-layer model, a 1-byte host).
"""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner

H100 = planner.gpu("H100-80GB")


def _refused(model: str, parallel: dict[str, Any], **train: Any) -> planner.SpecError:
    spec = planner.TrainSpec.model_validate({"parallel": parallel, **train})
    with pytest.raises(planner.SpecError) as estimate_err:
        planner.estimate(planner.load_model(model), spec, H100)
    with pytest.raises(planner.SpecError) as fit_err:
        planner.fit(planner.load_model(model), spec, H100)
    assert str(fit_err.value) == str(estimate_err.value)
    return estimate_err.value


@pytest.mark.parametrize("tp", [3, 64, 16])
def test_tp_must_divide_the_heads_and_kv_heads(tp: int) -> None:
    err = _refused("llama-3-8b", {"tp": tp})  # 32 heads, 8 KV heads
    assert err.field == "train.parallel.tp"
    assert str(err).startswith("train.parallel.tp:")
    assert "allowed: 1, 2, 4, 8" in str(err) and f"got {tp}" in str(err)


def test_tp_must_divide_the_ffn_widths() -> None:
    model = planner.load_model("llama-3-8b").model_copy(update={"ffn_hidden_size": 1000})
    assert model.num_heads % 8 == 0 and model.kv_heads % 8 == 0 and 1000 % 16
    planner.estimate(model, planner.TrainSpec(parallel={"tp": 8}), H100)
    with pytest.raises(planner.SpecError, match=r"ffn_hidden_size \(1000\)") as err:
        planner.estimate(model, planner.TrainSpec(parallel={"tp": 16}), H100)
    assert "allowed: 1, 2, 4, 8;" in str(err.value)


def test_pp_must_not_exceed_the_layers() -> None:
    err = _refused("llama-3-8b", {"pp": 64})  # 32 layers
    assert err.field == "train.parallel.pp"
    assert "between 1 and num_layers (32)" in str(err) and "got 64" in str(err)


def test_ep_must_divide_the_experts() -> None:
    err = _refused("mixtral-8x7b", {"dp": 3, "ep": 3})  # 8 experts
    assert err.field == "train.parallel.ep"
    assert "allowed: 1, 2, 4, 8" in str(err) and "got 3" in str(err)
    err = _refused("llama-3-8b", {"dp": 2, "ep": 2})
    assert err.field == "train.parallel.ep" and "no experts" in str(err)


def test_sequence_parallel_must_divide_the_sequence() -> None:
    parallel = {"tp": 2, "sequence_parallel": True}
    with pytest.raises(planner.SpecError) as err:
        planner.estimate(
            planner.load_model("llama-3-8b"),
            planner.TrainSpec.model_validate({"seq_len": 4095, "parallel": parallel}),
            H100,
        )
    assert err.value.field == "train.seq_len"


def test_layouts_that_divide_are_still_estimated() -> None:
    for model, parallel in [
        ("llama-3-70b", {"tp": 8, "pp": 4, "dp": 8}),
        ("llama-3-8b", {"tp": 8, "pp": 32}),
        ("mixtral-8x7b", {"dp": 8, "ep": 8, "tp": 2}),
        ("deepseek-v3", {"pp": 16, "dp": 64, "ep": 64}),
    ]:
        spec = planner.TrainSpec.model_validate({"parallel": parallel})
        assert planner.estimate(planner.load_model(model), spec, H100).gpu_peak_bytes > 0


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"micro_batch_size": True}, "train.micro_batch_size"),
        ({"grad_accum_steps": True}, "train.grad_accum_steps"),
        ({"parallel": {"tp": True}}, "train.parallel.tp"),
        ({"recompute": {"every_k": True}}, "train.recompute"),
        ({"offload": {"mode": "optimizer", "fraction": True}}, "train.offload.fraction"),
        ({"moe_imbalance": True}, "train.moe_imbalance"),
    ],
)
def test_training_counts_are_not_booleans(data: dict[str, Any], field: str) -> None:
    with pytest.raises(planner.SpecError) as err:
        planner.load_train(data)
    assert err.value.field is not None and err.value.field.startswith(field), err.value.field


@pytest.mark.parametrize("key", ["num_layers", "num_heads", "vocab_size", "head_dim"])
def test_model_counts_are_not_booleans(key: str) -> None:
    data = {**planner.load_model("tiny-dense").model_dump(), key: True}
    with pytest.raises(planner.SpecError) as err:
        planner.load_model(data)
    assert err.value.field == f"model.{key}" or err.value.field == key, err.value.field


def test_hf_config_counts_are_not_booleans() -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": True,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    with pytest.raises(planner.SpecError) as err:
        planner.load_model(config)
    assert err.value.field == "num_hidden_layers" and "integer" in str(err.value)
    assert planner.load_model({**config, "num_hidden_layers": 2}).num_layers == 2


def test_hardware_sizes_are_not_booleans() -> None:
    with pytest.raises(planner.SpecError):
        planner.load_hardware("H100-80GB", host_memory=True)
    with pytest.raises(planner.SpecError):
        planner.load_hardware({**H100.model_dump(), "memory_bytes": True})
    with pytest.raises(planner.SpecError):
        planner.load_hardware("H100-80GB", gpus_per_node=True)


def test_gpus_per_node_is_capped_like_the_service() -> None:
    from headroom.planner.hardware import MAX_GPUS_PER_NODE

    assert planner.load_hardware("H100-80GB", gpus_per_node=MAX_GPUS_PER_NODE).gpus_per_node
    with pytest.raises(planner.SpecError) as err:
        planner.load_hardware("H100-80GB", gpus_per_node=10**20)
    assert err.value.field == "gpus_per_node" and f"{MAX_GPUS_PER_NODE}" in str(err.value)
