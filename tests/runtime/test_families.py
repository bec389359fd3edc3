"""What the bundled trainer builds of the families ``planner.hf`` reads: GeGLU MLPs and norms
that learn a weight only or nothing, with the parameters the planner counts; Gemma's, OLMo 2's
and Cohere's layer shapes, per-head query/key norm weights, sliding windows and soft-capping
are estimate-only, refused naming the field."""

from __future__ import annotations

import pytest
import torch

from headroom import planner
from headroom.runtime.model import DecoderLM

TINY = planner.load_model("tiny-dense")


def _spec(**update: object) -> planner.ModelSpec:
    return planner.ModelSpec.model_validate({**TINY.model_dump(), **update})


@pytest.mark.parametrize(
    "update",
    [
        {"ffn_kind": "geglu"},
        {"norm": "layernorm", "norm_params": "none"},
        {"norm": "layernorm", "norm_params": "weight"},
        {"norm_params": "weight_and_bias"},
    ],
)
def test_the_trainer_builds_what_the_planner_counts(update: dict[str, object]) -> None:
    spec = _spec(**update)
    with torch.device("meta"):
        net = DecoderLM(spec)
    assert sum(p.numel() for p in net.parameters()) == planner.count_params(spec).total


def test_a_geglu_mlp_gates_with_tanh_gelu() -> None:
    torch.manual_seed(0)
    net = DecoderLM(_spec(ffn_kind="geglu")).float()
    mlp = net.layers[0].mlp
    x = torch.randn(3, TINY.hidden_size)
    gate = torch.nn.functional.gelu(mlp.gate_proj(x), approximate="tanh")
    torch.testing.assert_close(mlp(x), mlp.down_proj(gate * mlp.up_proj(x)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("norm_placement", "sandwich"),
        ("norm_placement", "parallel"),
        ("sliding_window", 8),
        ("final_logit_softcap", 30.0),
    ],
)
def test_estimate_only_shapes_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(planner.SpecError) as err:
        DecoderLM(_spec(**{field: value}))
    assert err.value.field == f"model.{field}"
    assert "allowed" in str(err.value)
