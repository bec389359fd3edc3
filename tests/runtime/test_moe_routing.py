"""Routing weights in fp32 (DeepSeek-V2/V3): read from their configs, counted where an MoE
layer's backward starts on its experts' outputs, held by the bundled trainer as counted: it
scales its experts' outputs a slab at a time, so no slot-wide fp32 tensor exists."""

from __future__ import annotations

import pytest
import torch

from headroom import planner
from headroom.planner.activations import layer_activations
from headroom.planner.buckets import moe_capacity
from headroom.planner.coefficients import default_coefficients


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
        return acts.backward_start_moe

    slots = base.moe.num_experts * moe_capacity(
        mb * seq // tp, base.moe.top_k, base.moe.num_experts, cf
    )
    assert temporaries(plain) == 0
    assert temporaries(base) == 2 * slots * base.hidden_size * 4 // tp


def test_the_bundled_trainer_holds_what_the_planner_counts_for_fp32_routing_weights() -> None:
    """The trainer's MoE layer scales its experts' outputs by fp32 routing weights when the
    spec says so, a slab at a time: where its backward starts on those outputs it holds one
    slab's fp32 copy of the incoming gradient and one fp32 product, 6 bytes an element more
    than with 16-bit weights (a 16-bit product), as the runtime profile counts, and no
    slot-wide fp32 tensor (eager autograd held two more than 16-bit routing, 42 MB here)."""
    import math

    from headroom.calibration.design import PURE_BF16
    from headroom.calibration.tracing import layer_backward_peak, trace
    from headroom.planner.buckets import ROUTING_SLAB_ELEMENTS, routing_slabs

    spec = planner.ModelSpec.model_validate(
        {
            "name": "mla-moe", "vocab_size": 4000, "hidden_size": 512, "num_layers": 2,
            "num_heads": 8, "ffn_hidden_size": 1408,
            "mla": {"q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
                    "qk_rope_head_dim": 16, "v_head_dim": 32},
            "moe": {"num_experts": 16, "top_k": 4, "expert_ffn_size": 256,
                    "dense_first_layers": 1, "router_bias": True},
        }
    )  # fmt: skip
    assert spec.moe is not None
    train = planner.load_train({"micro_batch_size": 1, "seq_len": 2048, "precision": PURE_BF16})
    peaks, predicted = {}, {}
    for fp32 in (False, True):
        moe = spec.moe.model_copy(update={"routing_weights_fp32": fp32})
        model = spec.model_copy(update={"moe": moe})
        peaks[fp32] = layer_backward_peak(trace(model, train))
        acts = layer_activations(
            model, default_coefficients("runtime"), 1, 2048, 2, False, 1, 1, 1, False, 1.25, 1.0
        )
        predicted[fp32] = acts.backward_start_moe
    capacity = math.ceil(1.25 * 2048 * spec.moe.top_k / spec.moe.num_experts)
    experts, run = routing_slabs(spec.moe.num_experts, capacity, 512, ROUTING_SLAB_ELEMENTS)
    slab = experts * run * spec.hidden_size
    assert 0 < slab < spec.moe.num_experts * capacity * spec.hidden_size  # more than one slab
    slots = spec.moe.num_experts * capacity
    # to the byte but for the routing weights themselves (a few bytes a slot)
    assert abs(peaks[True] - peaks[False] - 6 * slab) <= 8 * slots
    # the planner's as-it-starts point: the two slot-wide 16-bit tensors and a 16-bit
    # product slab, and with fp32 weights the same 6 bytes a slab element more
    two_slot_tensors_and_a_slab = 2 * slots * spec.hidden_size * 2 + 2 * slab
    assert predicted[False] == two_slot_tensors_and_a_slab
    assert predicted[True] == two_slot_tensors_and_a_slab + 6 * slab


def test_the_trainer_scales_by_routing_weights_in_the_slabs_the_runtime_profile_counts() -> None:
    from headroom.calibration.regression import STRUCTURAL
    from headroom.planner.buckets import ROUTING_SLAB_ELEMENTS

    runtime = default_coefficients("runtime")
    assert runtime.routing_product_slab_elements == ROUTING_SLAB_ELEMENTS
    for name, value in STRUCTURAL["runtime"].items():
        assert getattr(runtime, name) == value, name
    # eager autograd's profiles: slot-wide, two fp32 tensors more than 16-bit routing
    for profile in ("textbook", "hf"):
        coeffs = default_coefficients(profile)
        assert coeffs.routing_product_slab_elements is None
        assert coeffs.routing_fp32_bytes_per_element == 8.0


@pytest.mark.parametrize(
    ("y_dtype", "w_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize(
    ("shape", "limit"),
    [((5, 7, 33), 1 << 22), ((6, 50, 40), 4_000), ((3, 90, 40), 1_000), ((4, 3, 8), 1)],
)
def test_the_slab_wise_routing_scale_is_eager_autograd_to_the_bit(
    monkeypatch: pytest.MonkeyPatch,
    y_dtype: torch.dtype,
    w_dtype: torch.dtype,
    shape: tuple[int, int, int],
    limit: int,
) -> None:
    """Output and both gradients equal ``(y * w[..., None]).to(y.dtype)``'s under autograd,
    bit for bit: one slab, whole experts per slab, runs of one expert's slots, single slots.
    ``y`` is transposed, as the batched experts make it; its gradient keeps its layout."""
    import headroom.runtime.model as rm

    monkeypatch.setattr(rm, "ROUTING_SLAB_ELEMENTS", limit)
    experts, slots, width = shape
    torch.manual_seed(7)
    base = torch.randn(experts, width, slots).to(y_dtype)
    weights = torch.rand(experts, slots).to(w_dtype)
    incoming = torch.randn(shape).to(y_dtype)
    y_ref, y_new = (base.clone().requires_grad_() for _ in range(2))
    w_ref, w_new = (weights.clone().requires_grad_() for _ in range(2))
    eager = (y_ref.transpose(1, 2) * w_ref.unsqueeze(-1)).to(y_dtype)
    slab_wise = rm._ScaleByRoutingWeights.apply(y_new.transpose(1, 2), w_new)
    eager.backward(incoming)
    slab_wise.backward(incoming)
    one_slab = experts * slots * width <= limit
    assert (len(rm._slabs(torch.Size(shape))) == 1) == one_slab
    assert slab_wise.dtype == y_dtype and slab_wise.is_contiguous()
    assert torch.equal(eager, slab_wise)
    assert y_ref.grad is not None and y_new.grad is not None
    assert w_ref.grad is not None and w_new.grad is not None
    assert torch.equal(y_ref.grad, y_new.grad) and torch.equal(w_ref.grad, w_new.grad)
    covered = torch.zeros(experts, slots, dtype=torch.int64)
    for at in rm._slabs(torch.Size(shape)):
        covered[at] += 1
        assert covered[at].numel() * width <= max(limit, width)
    assert bool((covered == 1).all())  # every slot exactly once


def test_fp32_routing_products_are_held_before_the_routed_experts_gradients() -> None:
    """Under full recompute an MLA-MoE layer's backward peaks as it starts on its routed
    experts' outputs: the fp32 products' gradients exist, of the layer's own gradients only the
    shared experts'. Counting a share of the routed experts' gradients there too over-predicted
    the traced peak by 3.3 %."""
    from headroom.calibration.design import PURE_BF16, load_design
    from headroom.calibration.regression import TRACE_DEVICE
    from headroom.calibration.tracing import trace
    from headroom.planner.hf import from_hf_config

    config = load_design("hf").shape("hf-trace-mla-0").hf_config
    assert config is not None
    model = from_hf_config({**config, "_name_or_path": "mla-moe"})
    assert model.moe is not None and model.moe.routing_weights_fp32
    train = planner.TrainSpec.model_validate(
        {
            "micro_batch_size": 2,
            "seq_len": 512,
            "recompute": "full",
            "precision": PURE_BF16,
            "activation_profile": "runtime",
        }
    )
    measured = trace(model, train)["peak"]
    budget = planner.estimate(model, train, TRACE_DEVICE)
    assert budget.peak_phase == "backward"
    error = budget.gpu_peak_bytes / measured["total"] - 1
    assert abs(error) <= 0.015, error
