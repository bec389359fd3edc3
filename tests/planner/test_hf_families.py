"""The families ``planner.hf`` reads beyond Llama, Qwen, Mixtral and DeepSeek: Gemma 1-3,
Phi-3, OLMo and OLMo 2, StarCoder2, Granite, Cohere (Command R, R7B) and InternLM2.

Each is read from its ``config.json`` as transformers defines it: every bundled config, and
small configs of each family with each option it has, count exactly the parameters
transformers' own modules hold (built on the meta device: nothing allocated). The published
totals are in ``test_params.py``. What the layers save is priced by the derived terms and,
under a profile whose traces never ran such layers, flagged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from headroom import planner
from headroom.planner.hf import GEMMA3_TEXT_DEFAULTS, from_hf_config
from headroom.planner.steptime import StepModel, sliding_window_keys

transformers = pytest.importorskip("transformers")

HF_DIR = Path(planner.__file__).parent / "data" / "hf"
#: the bundled configs of the families read here (InternLM2's modeling code is its own, not
#: transformers': its published total holds it, in test_params.py)
BUNDLED = (
    "gemma-2-2b",
    "gemma-2-9b",
    "gemma-2-27b",
    "gemma-3-1b-it",
    "phi-3-mini-4k-instruct",
    "phi-3-medium-4k-instruct",
    "olmo-2-1124-7b",
    "olmo-2-1124-13b",
    "starcoder2-3b",
    "starcoder2-7b",
    "starcoder2-15b",
    "granite-3.1-8b-instruct",
)
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: each family with each option that changes its tensors
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("gemma", {"head_dim": 16}),
    ("gemma", {"head_dim": 16, "attention_bias": True}),
    ("gemma2", {"head_dim": 16}),
    ("gemma2", {"head_dim": 16, "tie_word_embeddings": False}),
    ("gemma3_text", {"head_dim": 16}),
    ("phi3", {}),
    ("olmo", {}),
    ("olmo", {"tie_word_embeddings": True, "attention_bias": True}),
    ("olmo2", {}),
    ("starcoder2", {}),
    ("starcoder2", {"use_bias": False, "tie_word_embeddings": False}),
    ("granite", {}),
    ("granite", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("cohere", {}),
    ("cohere", {"use_qk_norm": True}),
    ("cohere2", {}),
]


def transformers_count(config: dict[str, Any]) -> int:
    """The parameters transformers' model of ``config`` holds (its language model: a
    multimodal config's text_config), built on the meta device."""
    model_type = config["model_type"]
    fields = {k: v for k, v in config.items() if k not in ("model_type", "_name_or_path")}
    if model_type == "gemma3":
        model_type, fields = "gemma3_text", dict(fields["text_config"])
        fields.pop("model_type", None)
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_count_what_transformers_builds(name: str) -> None:
    config = json.loads((HF_DIR / f"{name}.json").read_text())
    assert planner.count_params(planner.load_model(name)).total == transformers_count(config)


@pytest.mark.parametrize(
    ("model_type", "extra"), VARIANTS, ids=[f"{t}-{i}" for i, (t, _) in enumerate(VARIANTS)]
)
def test_each_familys_options_count_what_transformers_builds(
    model_type: str, extra: dict[str, Any]
) -> None:
    config = {**SMALL, **extra, "model_type": model_type}
    assert planner.count_params(from_hf_config(config)).total == transformers_count(config)


def test_a_multimodal_gemma3_config_is_read_as_its_language_model() -> None:
    """``model_type: gemma3`` holds the language model in ``text_config``, which leaves keys
    to Gemma3TextConfig's defaults: read as the text-only config reads, with the vision tower
    named as not priced."""
    text = json.loads((HF_DIR / "gemma-3-1b-it.json").read_text())
    multimodal = {
        "model_type": "gemma3",
        "text_config": {k: v for k, v in text.items() if k not in ("vocab_size", "head_dim")},
        "vision_config": {"hidden_size": 1152},
    }
    spec = from_hf_config(multimodal)
    # the defaults stand in for the two keys left out (262,208 and 256 are Gemma 3's)
    expected = from_hf_config({**text, "vocab_size": 262_208, "head_dim": 256})
    assert spec.model_dump(exclude={"name", "source"}) == expected.model_dump(
        exclude={"name", "source"}
    )
    assert spec.source is not None and "vision tower is not priced" in spec.source
    assert planner.count_params(spec).total == transformers_count(multimodal)


def test_gemma3_text_defaults_are_transformers() -> None:
    """The defaults read where a Gemma 3 text_config leaves keys out are Gemma3TextConfig's;
    its one global layer in six is the layer_types transformers writes by default."""
    defaults = transformers.Gemma3TextConfig()
    pattern = GEMMA3_TEXT_DEFAULTS["sliding_window_pattern"]
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key != "sliding_window_pattern":
            assert getattr(defaults, key) == value, key
    assert defaults.layer_types == [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(defaults.num_hidden_layers)
    ]


def test_gemma2_reads_its_layer_shape() -> None:
    gemma = planner.load_model("gemma-2-9b")
    assert (gemma.ffn_kind, gemma.norm_placement, gemma.tied_embeddings) == (
        "geglu",
        "sandwich",
        True,
    )
    assert (gemma.sliding_window, gemma.global_attention_every) == (4096, 2)
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (50.0, 30.0)
    # every other layer slides, from the first (transformers: not layer_idx % 2)
    assert gemma.sliding_layers_between(0, 42) == 21
    assert gemma.sliding_layers_between(0, 1) == 1 and gemma.sliding_layers_between(1, 2) == 0
    olmo2 = planner.load_model("olmo-2-1124-7b")
    assert (olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_weights) == (
        "post",
        True,
        "per_head",
    )
    starcoder = planner.load_model("starcoder2-15b")
    assert (starcoder.ffn_kind, starcoder.norm, starcoder.linear_bias, starcoder.dropout) == (
        "gelu",
        "layernorm",
        True,
        True,
    )


@pytest.mark.parametrize(
    ("types", "every"),
    [
        (["sliding_attention"] * 5 + ["full_attention"], 6),
        (["sliding_attention", "full_attention"] * 3, 2),
        (["sliding_attention"] * 4, None),
    ],
)
def test_layer_types_give_the_global_layers(types: list[str], every: int | None) -> None:
    config = {**SMALL, "model_type": "gemma3_text", "num_hidden_layers": len(types)}
    spec = from_hf_config({**config, "sliding_window": 8, "layer_types": types})
    assert (spec.sliding_window, spec.global_attention_every) == (8, every)
    assert spec.sliding_layers_between(0, len(types)) == types.count("sliding_attention")


def test_irregular_layer_types_are_refused_naming_the_field() -> None:
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    with pytest.raises(planner.SpecError) as err:
        from_hf_config(
            {
                **SMALL,
                "model_type": "gemma2",
                "num_hidden_layers": 4,
                "sliding_window": 8,
                "layer_types": types,
            }
        )
    assert err.value.field == "layer_types"
    assert "repeat one pattern" in str(err.value)


H100 = planner.gpu("H100-80GB")


def _estimate(model: planner.ModelSpec, **train: Any) -> planner.Budget:
    spec = {"seq_len": 8192, "micro_batch_size": 1, "activation_profile": "textbook", **train}
    return planner.estimate(model, planner.TrainSpec.model_validate(spec), H100)


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_a_sliding_window_saves_what_full_attention_saves(attention: str) -> None:
    """Flash attention saves no score either way; eager attention (transformers' for these
    families) computes every score and masks the window: the same memory."""
    mistral = planner.load_model("mistral-7b")
    assert mistral.sliding_window == 4096
    full = mistral.model_copy(update={"sliding_window": None})
    assert _estimate(mistral, attention=attention).gpu_peak_bytes == (
        _estimate(full, attention=attention).gpu_peak_bytes
    )


def test_a_sliding_window_cuts_attentions_flops_under_a_kernel_that_skips_blocks() -> None:
    assert sliding_window_keys(8192, None) == sliding_window_keys(8192, 8192) == 8192
    # position i attends min(i + 1, w) keys: sum over 8 positions with w = 4 is 26, doubled
    assert sliding_window_keys(8, 4) == pytest.approx(2 * 26 / 8)
    mistral = planner.load_model("mistral-7b")
    full = mistral.model_copy(update={"sliding_window": None})
    coeffs = planner.default_coefficients("textbook")

    def flops(model: planner.ModelSpec, seq: int, flash: bool) -> float:
        return StepModel(model, seq, 1, H100, coeffs, causal_skip=flash).flops_base

    d_attn = mistral.num_heads * mistral.dim_per_head
    # 32 layers at 8,192 tokens: 2·4096 - 4096²/8192 (plus the window's own +1 per key) keys
    saved = 6 * 32 * d_attn * (8192 - sliding_window_keys(8192, 4096))
    assert flops(full, 8192, True) - flops(mistral, 8192, True) == pytest.approx(saved)
    assert saved > 0
    # eager attention computes the whole score matrix: no saving; nor at or under the window
    assert flops(mistral, 8192, False) == flops(full, 8192, False)
    assert flops(mistral, 4096, True) == flops(full, 4096, True)


def test_sandwich_norms_and_soft_capped_logits_save_more() -> None:
    """Gemma 2's four norms a layer save two more inputs than two would; soft-capped logits
    keep tanh's output, one logits-sized 16-bit tensor (textbook profile: derived terms)."""
    gemma = planner.load_model("gemma-2-2b")
    tokens = 8192
    forward = "forward"

    def activations(model: planner.ModelSpec) -> int:
        return _estimate(model).gpu.phases[forward].buckets["activations"]

    pre = gemma.model_copy(update={"norm_placement": "pre"})
    two_more = 2 * tokens * gemma.hidden_size * 2 * gemma.num_layers
    assert activations(gemma) - activations(pre) == two_more
    uncapped = gemma.model_copy(update={"final_logit_softcap": None})
    budget, without = _estimate(gemma), _estimate(uncapped)
    logits = tokens * gemma.vocab_size * 2
    kept = ("activations", "logits")
    extra = sum(budget.gpu.phases[forward].buckets[k] for k in kept) - sum(
        without.gpu.phases[forward].buckets[k] for k in kept
    )
    assert extra == logits


def test_a_parallel_blocks_mlp_shares_the_attentions_input() -> None:
    """Cohere's one norm feeds attention and the MLP: one norm input saved, and the MLP's
    input is the attention's, saved once."""
    cohere = from_hf_config({**SMALL, "model_type": "cohere", "hidden_size": 64})
    pre = cohere.model_copy(update={"norm_placement": "pre"})
    budget = _estimate(cohere, seq_len=1024).gpu.phases["forward"].buckets["activations"]
    sequential = _estimate(pre, seq_len=1024).gpu.phases["forward"].buckets["activations"]
    assert sequential - budget == 2 * 1024 * 64 * 2 * cohere.num_layers


def _flagged(budget: planner.Budget) -> list[str]:
    return [w.split(":")[0] for w in budget.warnings if "profile's traces never ran" in w]


@pytest.mark.parametrize("profile", ["hf", "torchtitan", "runtime"])
def test_layers_no_trace_of_the_profile_ran_are_flagged(profile: str) -> None:
    """Their profiles were fitted to Llama-shaped layers only: Gemma 2's are priced by the
    derived terms under the fitted scales, and the budget says so, naming each field."""
    gemma = planner.load_model("gemma-2-2b")
    budget = _estimate(gemma, activation_profile=profile, seq_len=2048)
    assert _flagged(budget) == [
        "model.ffn_kind",
        "model.norm_placement",
        "model.attn_logit_softcap",
        "model.final_logit_softcap",
    ]
    llama = _estimate(planner.load_model("llama-3-8b"), activation_profile=profile, seq_len=2048)
    assert _flagged(llama) == []


def test_megatrons_traces_ran_gpt_layers_but_no_gemma_ones() -> None:
    gpt = planner.load_model("gpt3-175b").model_copy(update={"num_layers": 4})
    train = {"activation_profile": "megatron", "framework": "megatron", "seq_len": 2048}
    assert _flagged(_estimate(gpt, **train)) == []
    starcoder = planner.load_model("starcoder2-3b")
    assert _flagged(_estimate(starcoder, **train)) == []  # LayerNorm, GeLU: traced
    olmo2 = planner.load_model("olmo-2-1124-7b")
    assert _flagged(_estimate(olmo2, **train)) == ["model.norm_placement", "model.qk_norm_weights"]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"model_type": "starcoder2", "attention_dropout": [None, None]}, "attention_dropout"),
        ({"model_type": "starcoder2", "residual_dropout": 1.5}, "residual_dropout"),
        ({"model_type": "cohere2", "sliding_window": 0}, "sliding_window"),
        ({"model_type": "gemma2", "layer_types": ["sliding_attention", 0]}, "layer_types"),
        ({"model_type": "cohere2", "sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"model_type": "gemma2", "hidden_activation": "gelu", "hidden_act": "AAA"}, "hidden_act"),
        ({"model_type": "gemma", "hidden_activation": ""}, "hidden_activation"),
    ],
)
def test_a_key_a_family_reads_is_checked_even_where_another_decides(
    config: dict[str, Any], field: str
) -> None:
    """Every key a reader takes is checked as the API's schema documents it, used or not (a
    layer list without a window, an activation the other key overrides): what the schema
    refuses, the reader refuses too, naming the key."""
    with pytest.raises(planner.SpecError) as err:
        from_hf_config({**SMALL, **config})
    assert err.value.field == field
