"""The step-time model of streaming: what of the compute the CPU optimizer hides depends on
whether the step clips its gradients (the update waits for the whole step's norm) or not (each
unit is updated as its last gradient lands)."""

from __future__ import annotations

import pytest

from headroom import planner
from headroom.planner.steptime import StepModel


def _price(cpu_rate: float, max_grad_norm: float | None, grad_accum: int) -> tuple[float, ...]:
    model = planner.load_model("llama-3-8b")
    hw = planner.gpu("H200-141GB")
    coeffs = planner.default_coefficients("runtime").model_copy(
        update={"cpu_optimizer_params_per_s": cpu_rate}
    )
    train = planner.TrainSpec(
        micro_batch_size=1,
        seq_len=4096,
        grad_accum_steps=grad_accum,
        offload={"mode": "streaming", "checkpoint_every": 1},
        max_grad_norm=max_grad_norm,
    )
    numel = planner.count_params(model).total
    t = StepModel(model, 4096, 1, hw, coeffs)(planner.knobs(train), numel, 0)
    return t.compute_seconds, t.transfer_seconds, t.cpu_optimizer_seconds, t.step_seconds


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_a_cpu_bound_step_hides_more_without_clipping(grad_accum: int) -> None:
    compute, transfer, cpu, clipped = _price(1e9, 1.0, grad_accum)
    _, _, _, unclipped = _price(1e9, None, grad_accum)
    assert cpu > max(compute, transfer)  # CPU-bound at 1 G params/s
    # recompute and backward are three quarters of a streamed micro-batch's FLOPs (attention
    # included, ± its share); clipping hides its forward only, the other way hides the rest
    per_micro = compute / grad_accum
    assert clipped == pytest.approx(cpu + compute - per_micro / 4, rel=0.02)
    assert unclipped == pytest.approx(cpu + compute - 3 * per_micro / 4, rel=0.02)
    assert max(compute, transfer, cpu) < unclipped < clipped


def test_a_compute_bound_step_is_its_compute_either_way() -> None:
    for norm in (1.0, None):
        compute, transfer, _, step = _price(1e12, norm, 1)
        assert step == max(compute, transfer)


def test_a_gpus_own_compute_efficiency_wins_over_the_coefficients() -> None:
    """The H100's efficiency is fitted to published H100 runs (0.465); a GPU with no fit of its
    own (the A100s, whose runs fitted the coefficients' 0.648) prices at the coefficients'."""
    model = planner.load_model("llama-3-8b")
    coeffs = planner.default_coefficients("textbook")
    h100, a100 = planner.gpu("H100-80GB"), planner.gpu("A100-80GB")
    assert h100.compute_efficiency == 0.465 and a100.compute_efficiency is None
    assert StepModel(model, 4096, 1, h100, coeffs).flops_per_s == pytest.approx(989e12 * 0.465)
    assert StepModel(model, 4096, 1, a100, coeffs).flops_per_s == pytest.approx(
        a100.bf16_flops * coeffs.compute_efficiency
    )
    # a coefficient set's own value never overrides a GPU's fit; a custom GPU may carry its own
    other = coeffs.model_copy(update={"compute_efficiency": 0.9})
    assert StepModel(model, 4096, 1, h100, other).flops_per_s == pytest.approx(989e12 * 0.465)
    custom = a100.model_copy(update={"compute_efficiency": 0.5})
    assert StepModel(model, 4096, 1, custom, other).flops_per_s == pytest.approx(
        a100.bf16_flops * 0.5
    )
