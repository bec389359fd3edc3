"""torch's ring attention backward (context parallelism as torchtitan runs it): the planner's
term is what torch's own function holds, traced on a CPU, and the estimate holds it at a
layer's backward under FSDP2's stacks."""

from __future__ import annotations

import pytest
import torch

from headroom import planner
from headroom.calibration.ring_attention import trace_ring_backward
from headroom.planner.activations import ring_attention_backward
from headroom.planner.estimator import stage_terms_from_knobs


@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "cp", "dtype"),
    [
        (4096, 8, 64, 2, torch.bfloat16),
        (2048, 4, 64, 3, torch.bfloat16),
        (4096, 8, 64, 8, torch.bfloat16),
        (1024, 16, 128, 4, torch.bfloat16),
        (2048, 8, 64, 4, torch.float32),
    ],
)
def test_the_term_is_what_torchs_ring_backward_holds(
    tokens: int, heads: int, head_dim: int, cp: int, dtype: torch.dtype
) -> None:
    traced = trace_ring_backward(tokens, heads, head_dim, cp, dtype)
    elements = tokens * heads * head_dim
    act_bytes = torch.empty((), dtype=dtype).element_size()
    # the log-sum-exp and the ring's small tensors (a value or two per position and head)
    # are left out: under 1 % of it
    assert ring_attention_backward(elements, act_bytes, cp) == pytest.approx(traced, rel=0.01)


def _terms(framework: str, cp: int) -> planner.estimator.StageTerms:
    train = planner.TrainSpec.model_validate(
        {
            "seq_len": 32768,
            "framework": framework,
            "recompute": "full",
            "parallel": {"dp": 2, "cp": cp, "zero_stage": 3 if framework == "fsdp2" else 0},
        }
    )
    model = planner.load_model("llama-3-8b")
    coeffs = planner.default_coefficients("textbook")
    return stage_terms_from_knobs(model, planner.knobs(train), coeffs, 0)


def test_fsdp2_context_parallelism_holds_the_ring_at_a_layers_backward() -> None:
    """Llama 3 8B at 32k tokens over CP 4: each rank's 8,192 positions of 32 query heads
    (keys and values repeated to them) of 128."""
    ring = _terms("fsdp2", 4).activations.temporaries.dense.end
    assert ring == ring_attention_backward(8192 * 32 * 128, 2, 4)
    # without CP, or without torch's ring (Megatron's CP is Transformer Engine's), none
    assert _terms("fsdp2", 1).activations.temporaries.dense.end == 0
    assert _terms("none", 4).activations.temporaries.dense.end == 0
