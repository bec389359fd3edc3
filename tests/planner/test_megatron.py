"""``framework: megatron`` against Megatron-LM's theoretical memory report
(``megatron/training/theoretical_memory_usage.py``, ``compute_weight_and_optimizer_memory``:
18 bytes a parameter, or 6 + 12/dp with the distributed optimizer: 16-bit weights, fp32 main
gradients, fp32 master weights and two moments). Megatron-Core's pip package does not ship
``megatron/training``, so the report's rule is stated here, not imported."""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner

MODEL = planner.load_model("llama-3-70b")
GPU = planner.gpu("H100-80GB")
BF16 = {"params": "bf16", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}
STATES = ("params", "grads", "master_params", "optimizer_states")


def _train(**values: Any) -> planner.TrainSpec:
    spec: dict[str, Any] = {
        "framework": "megatron",
        "precision": BF16,
        "optimizer_impl": "fused",
        "parallel": {"dp": 8, "tp": 8, "pp": 4},
    }
    return planner.TrainSpec.model_validate({**spec, **values})


def _per_parameter(train: planner.TrainSpec) -> float:
    """Model-state bytes per local parameter of the heaviest stage, in the optimizer step."""
    budget = planner.estimate(MODEL, train, GPU)
    row = budget.gpu.phases["optimizer"].buckets
    coeffs = planner.default_coefficients("textbook")
    sp = planner.estimator.stage_terms_from_knobs(
        MODEL, planner.knobs(train), coeffs, budget.stage
    ).stage_params
    return sum(row[b] for b in STATES) / (sp.dense_numel + sp.expert_numel)


@pytest.mark.parametrize("dp", [1, 8, 64])
def test_model_states_are_megatrons_report(dp: int) -> None:
    """6 + 12/dp bytes a parameter with the distributed optimizer, 18 without."""
    sharded = _per_parameter(_train(parallel={"dp": dp, "tp": 8, "pp": 4}))
    assert sharded == pytest.approx(6 + 12 / dp, rel=1e-6)
    whole = _per_parameter(
        _train(parallel={"dp": dp, "tp": 8, "pp": 4}, megatron={"use_distributed_optimizer": False})
    )
    assert whole == pytest.approx(18, rel=1e-9)


def test_the_main_gradient_buffer_is_resident() -> None:
    """The contiguous fp32 buffer exists in every phase (forward too), and no gradient or
    bucket exists beside it: backward holds the buffer, not more."""
    budget = planner.estimate(MODEL, _train(), GPU)
    phases = budget.gpu.phases
    buffer = phases["optimizer"].buckets["grads"]
    assert buffer > 0
    for name in ("step1_forward", "forward"):
        assert phases[name].buckets["grads"] == buffer
    assert phases["backward"].buckets["grads"] >= buffer
    assert all(p.buckets["transfer_buffers"] == 0 for p in phases.values())
    # bf16 main gradients halve it
    bf16 = planner.estimate(MODEL, _train(precision={**BF16, "grads": "bf16"}), GPU)
    assert 2 * bf16.gpu.phases["optimizer"].buckets["grads"] == buffer


def test_the_optimizer_offload_is_megatrons_hybrid_optimizer() -> None:
    """optimizer_cpu_offload at a fraction: that share of the master weights and moments (and
    its fp32 gradients) in host RAM."""
    on_gpu = planner.estimate(MODEL, _train(), GPU)
    half = planner.estimate(MODEL, _train(offload={"mode": "optimizer", "fraction": 0.5}), GPU)
    assert half.gpu_peak_bytes < on_gpu.gpu_peak_bytes
    assert half.host_peak_bytes > 0 and on_gpu.host_peak_bytes == 0


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"parallel": {"dp": 8, "zero_stage": 1}}, "parallel.zero_stage"),
        ({"parallel": {"dp": 8}, "offload": {"mode": "streaming"}}, "offload.mode"),
    ],
)
def test_megatron_refuses_what_it_does_not_run(values: dict[str, Any], field: str) -> None:
    with pytest.raises(planner.SpecError) as info:
        planner.estimate(MODEL, _train(**values), GPU)
    assert info.value.field == field
