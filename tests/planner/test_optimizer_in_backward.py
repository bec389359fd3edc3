"""``optimizer_in_backward``: torchtune's ``optimizer_in_bwd`` steps each parameter as its
gradient lands and frees the gradient, so no model-wide gradient exists and the step at the
end is gone (``tests/calibration/test_optimizer_temporaries.py`` runs the mechanism with
torch's AdamW)."""

from __future__ import annotations

import pytest

from headroom import planner
from headroom.planner import buckets as b
from headroom.planner.params import count_params
from headroom.planner.trainable import check_loss

LLAMA = planner.load_model("llama-3-8b")
A100 = planner.gpu("A100-80GB")


def _train(**over: object) -> planner.TrainSpec:
    base: dict[str, object] = {
        "micro_batch_size": 1,
        "seq_len": 4096,
        "precision": {
            "params": "bf16",
            "grads": "bf16",
            "master": "none",
            "optimizer_states": "bf16",
        },
        "optimizer_impl": "foreach",
        "recompute": "full",
        "max_grad_norm": None,
        "activation_profile": "hf",
    }
    return planner.TrainSpec.model_validate({**base, **over})


def test_no_model_wide_gradient_and_no_step_at_the_end() -> None:
    """Stepped in the backward, the gradients bucket never holds more than the largest
    tensor's gradient and its step's temporaries (counted with it: they exist while that
    gradient does; the untied 8B: the 128,256 x 4,096 head or
    embedding, 1.0 GiB in bf16, and foreach's one state-sized temporary); the step phase
    reads no gradients. The estimate drops by the model's gradients and its foreach
    temporary (2 x 16 GB) at the step, which was the peak."""
    eager = planner.estimate(LLAMA, _train(), A100)
    fused = planner.estimate(LLAMA, _train(optimizer_in_backward=True), A100)
    table = 128256 * 4096
    one = table * 2
    temp = b.optimizer_temporary_bytes("adamw", "foreach", table, table, 0, 2, 0)
    assert eager.peak_phase == "optimizer"
    grads = [row.buckets["grads"] for row in fused.gpu.phases.values()]
    assert max(grads) <= one + temp
    assert fused.gpu.phases["optimizer"].buckets["grads"] == 0
    states = 2 * count_params(LLAMA).total * 2  # bf16 moments
    assert fused.gpu.phases["optimizer"].buckets["optimizer_states"] == states + temp
    n = count_params(LLAMA).total
    assert eager.gpu.phases["optimizer"].buckets["grads"] == 2 * n
    assert fused.gpu_peak_bytes < eager.gpu_peak_bytes - 2 * n
    assert fused.peak_phase != "optimizer"


@pytest.mark.parametrize(
    ("over", "field", "needle"),
    [
        ({"parallel": {"dp": 2}}, "optimizer_in_backward", "got parallel.dp=2"),
        (
            {"framework": "fsdp2", "parallel": {"dp": 1, "zero_stage": 3}},
            "optimizer_in_backward",
            "framework fsdp2",
        ),
        ({"grad_accum_steps": 4}, "grad_accum_steps", "allowed grad_accum_steps: 1, got 4"),
        ({"max_grad_norm": 1.0}, "max_grad_norm", "set max_grad_norm null (got 1.0)"),
    ],
)
def test_refused_where_torchtune_refuses_it_or_it_is_not_priced(
    over: dict[str, object], field: str, needle: str
) -> None:
    with pytest.raises(planner.SpecError) as raised:
        planner.estimate(LLAMA, _train(optimizer_in_backward=True, **over), A100)
    assert raised.value.field == field and needle in str(raised.value)


def test_the_bundled_trainer_does_not_take_it() -> None:
    """A launch of the bundled trainer refuses a step in the backward, naming the field,
    rather than train with a step at the end under an estimate without one."""
    check_loss(_train())
    with pytest.raises(planner.SpecError) as raised:
        check_loss(_train(optimizer_in_backward=True))
    assert raised.value.field == "optimizer_in_backward"
