"""Routing weights in fp32 (DeepSeek-V2/V3): read from their configs, counted where an MoE
layer's backward starts on its experts' outputs, refused by the bundled trainer."""

from __future__ import annotations

import pytest

import planner
from planner.activations import layer_activations
from planner.buckets import moe_capacity
from planner.coefficients import default_coefficients


def test_deepseek_configs_scale_by_fp32_routing_weights_and_others_do_not() -> None:
    deepseek = planner.load_model("deepseek-v3")
    assert deepseek.moe is not None and deepseek.moe.routing_weights_fp32
    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"):
        moe = planner.load_model(name).moe
        assert moe is not None and not moe.routing_weights_fp32, name


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_routing_weights_hold_two_fp32_slot_tensors_in_backward(tp: int) -> None:
    """With the textbook's coefficients a layer's backward holds nothing beyond its saved
    tensors, so the MoE layer's temporaries are exactly the fp32 products' gradients: two
    fp32 tensors of (slots, hidden), sequence parallelism splitting the hidden width."""
    base = planner.load_model("deepseek-v3").model_copy(update={"num_layers": 4})
    assert base.moe is not None
    plain = base.model_copy(
        update={"moe": base.moe.model_copy(update={"routing_weights_fp32": False})}
    )
    coeffs = default_coefficients("textbook")
    mb, seq, cf = 1, 4096, 1.25

    def temporaries(model: planner.ModelSpec) -> int:
        acts = layer_activations(model, coeffs, mb, seq, 2, False, tp, 1, 1, tp > 1, cf, 1.0)
        return acts.backward_ffn_moe

    slots = base.moe.num_experts * moe_capacity(
        mb * seq // tp, base.moe.top_k, base.moe.num_experts, cf
    )
    assert temporaries(plain) == 0
    assert temporaries(base) == 2 * slots * base.hidden_size * 4 // tp


def test_the_bundled_trainer_refuses_fp32_routing_weights() -> None:
    from runtime.support import check_supported

    moe = planner.load_model("tiny-moe").moe
    assert moe is not None
    spec = planner.load_model("tiny-moe").model_copy(
        update={"moe": moe.model_copy(update={"routing_weights_fp32": True})}
    )
    with pytest.raises(planner.SpecError) as info:
        check_supported(spec)
    assert info.value.field == "model.moe.routing_weights_fp32"
