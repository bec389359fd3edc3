"""Exact parameter counts of the bundled Hugging Face configs, and how counting treats ties,
raw config.json dicts and unsupported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headroom import planner

HF_DIR = Path(planner.__file__).parent / "data" / "hf"

# Published totals (main model; DeepSeek-V3's MTP module is reported separately).
TOTALS = {
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2-7b": 7_615_616_512,
    "qwen2-57b-a14b": 57_408_658_944,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    # the hub's safetensors metadata rounds these to 8.19B, 30.5B (3.3B active) and 235B (22B)
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v3": 671_026_419_200,
}

LEADERBOARD = "https://huggingface.co/datasets/open-llm-leaderboard/requests/blob"
#: published totals in billions, rounded as published (the Open LLM Leaderboard's requests
#: record the parameter count of each model evaluated), for the bundled configs whose
#: publishers give no exact total: (billions, its decimals, where, what it says)
PUBLISHED: dict[str, tuple[float, int, str, str]] = {
    "gemma-2-2b": (
        2.61,
        2,
        "https://huggingface.co/datasets/la-leaderboard/requests "
        "(google/gemma-2-2b_eval_request_False_float32_Original.json)",
        '"params": 2.61',
    ),
    "gemma-2-9b": (
        9.242,
        3,
        "https://huggingface.co/datasets/le-leadboard/requests (google/gemma-2-9b eval request)",
        '"params": 9.242',
    ),
    "gemma-2-27b": (
        27.227,
        3,
        "https://huggingface.co/datasets/OALL/requests_v2 "
        "(google/gemma-2-27b_eval_request_False_float16_Original.json)",
        '"params": 27.227',
    ),
    "phi-3-mini-4k-instruct": (
        3.821,
        3,
        "https://huggingface.co/datasets/le-leadboard/requests/blob/main/microsoft/"
        "Phi-3-mini-4k-instruct_eval_request_False_bfloat16_Original.json",
        '"params": 3.821',
    ),
    "phi-3-medium-4k-instruct": (
        13.96,
        2,
        "https://huggingface.co/datasets/open-llm-leaderboard/requests "
        "(microsoft/Phi-3-medium-4k-instruct, revision d194e4e)",
        '"params": 13.96',
    ),
    "olmo-2-1124-13b": (
        13.72,
        2,
        "https://raw.githubusercontent.com/jakemanger/whatmodel/main/pages/model/olmo-2-13b.md",
        "13.72B params (OLMo 2 13B Instruct, the same architecture)",
    ),
    "starcoder2-3b": (
        3.03,
        2,
        "https://huggingface.co/datasets/open-llm-leaderboard/requests/commit/"
        "b84bad5f538f2593d7e1642b87c6ce97155e1b86",
        '"params": 3.03',
    ),
    "starcoder2-7b": (
        7.174,
        3,
        f"{LEADERBOARD}/51c0d39b4031034cf21dd283b595e4567976e053/bigcode/"
        "starcoder2-7b_eval_request_False_bfloat16_Original.json",
        '"params": 7.174',
    ),
    "starcoder2-15b": (
        15.958,
        3,
        "https://huggingface.co/datasets/open-llm-leaderboard/requests "
        "(bigcode/starcoder2-15b_eval_request_False_float32_Original.json)",
        '"params": 15.958',
    ),
    "granite-3.1-8b-instruct": (
        8.171,
        3,
        "https://huggingface.co/datasets/la-leaderboard/requests "
        "(ibm-granite/granite-3.0-8b-instruct, the same architecture)",
        '"params": 8.171',
    ),
    "internlm2-20b": (
        19.861,
        3,
        f"{LEADERBOARD}/86b1162196b2b98f70037eb9fbcc269e8d9ebff5/internlm/"
        "internlm2-chat-20b_eval_request_False_bfloat16_Original.json",
        '"params": 19.861 (internlm2-chat-20b, the same architecture)',
    ),
}
#: bundled configs with no published total found: transformers' own count of the same config
#: holds them (``tests/planner/test_hf_families.py``)
UNPUBLISHED = {
    "gemma-3-1b-it": "Google's model card names the size (1B) only",
    "olmo-2-1124-7b": "no total found beside the name (7B)",
}
#: Gemma 2's paper (arXiv 2408.00118) gives each model's non-embedding count exactly: "The 2B
#: model has 2,024,517,888 non-embedding parameters, the 9B model has 8,324,201,984, and the
#: 27B model has 26,047,480,320."
GEMMA2_NON_EMBEDDING = {
    "gemma-2-2b": 2_024_517_888,
    "gemma-2-9b": 8_324_201_984,
    "gemma-2-27b": 26_047_480_320,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED.items()))
def test_published_rounded_totals(name: str, published: tuple[float, int, str, str]) -> None:
    billions, decimals, _, _ = published
    assert round(planner.count_params(planner.load_model(name)).total / 1e9, decimals) == billions


@pytest.mark.parametrize(("name", "count"), sorted(GEMMA2_NON_EMBEDDING.items()))
def test_gemma2_non_embedding_counts_are_the_papers(name: str, count: int) -> None:
    counts = planner.count_params(planner.load_model(name))
    assert counts.total - counts.embedding == count
    assert counts.head == 0  # the head is the embedding (tied)


SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "olmo",
    "olmo2",
    "starcoder2",
    "granite",
    "cohere",
    "cohere2",
    "internlm2",
)


def test_every_hf_fixture_has_an_expected_total() -> None:
    """Each bundled config has its published total: exact (``TOTALS``), or rounded as its
    publisher gives it (``PUBLISHED``), and transformers' own count besides
    (``tests/planner/test_hf_families.py``)."""
    fixtures = {p.stem for p in HF_DIR.glob("*.json")}
    assert fixtures == set(TOTALS) | set(PUBLISHED) | set(UNPUBLISHED)
    assert len(fixtures) == len(TOTALS) + len(PUBLISHED) + len(UNPUBLISHED)
    assert fixtures <= set(planner.model_names())


@pytest.mark.parametrize(("name", "total"), sorted(TOTALS.items()))
def test_total_params_exact(name: str, total: int) -> None:
    assert planner.count_params(planner.load_model(name)).total == total


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2-7b"])
def test_dense_models_are_fully_active(name: str) -> None:
    counts = planner.count_params(planner.load_model(name))
    assert counts.per_token_active == counts.total
    assert counts.mtp_excluded == 0


def test_qwen3_counts_its_query_and_key_norms() -> None:
    """Each layer of Qwen3 adds two head_dim norm weights (q_norm, k_norm) to Qwen2's shape
    without biases; the MoE model's routed experts are 8 of 128 per token."""
    qwen3 = planner.load_model("qwen3-8b")
    assert qwen3.qk_norm and not qwen3.qkv_bias
    without = planner.count_params(qwen3.model_copy(update={"qk_norm": False})).total
    assert TOTALS["qwen3-8b"] - without == qwen3.num_layers * 2 * qwen3.dim_per_head
    moe = planner.count_params(planner.load_model("qwen3-30b-a3b"))
    assert moe.per_token_active == 3_353_032_704
    assert planner.count_params(planner.load_model("qwen3-235b-a22b")).per_token_active == (
        22_190_763_520
    )


def test_deepseek_v3_mtp_and_active() -> None:
    counts = planner.count_params(planner.load_model("deepseek-v3"))
    assert counts.total == 671_026_419_200
    assert counts.mtp_excluded == 11_610_068_224
    assert counts.per_token_active == 37_552_297_472
    assert counts.per_token_active < counts.total


def test_mixtral_active_per_token() -> None:
    counts = planner.count_params(planner.load_model("mixtral-8x7b"))
    assert counts.per_token_active == 12_879_925_248
    assert counts.mtp_excluded == 0


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_config_dict_matches_preset(name: str) -> None:
    data = json.loads((HF_DIR / f"{name}.json").read_text())
    from_dict = planner.load_model(data)
    preset = planner.load_model(name)
    assert isinstance(from_dict, planner.ModelSpec)
    # Only the display name may differ (the preset is named after its file).
    assert preset.name == name
    assert from_dict.model_copy(update={"name": name}) == preset
    assert planner.count_params(from_dict) == planner.count_params(preset)


def _small(tied: bool, **extra: object) -> planner.ModelSpec:
    return planner.ModelSpec(
        vocab_size=1000,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=192,
        tied_embeddings=tied,
        **extra,
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"norm": "layernorm", "ffn_kind": "gelu", "linear_bias": True},
        {"moe": planner.MoESpec(num_experts=4, top_k=2, expert_ffn_size=96)},
    ],
    ids=["dense", "gpt-style", "moe"],
)
def test_tied_embeddings_counted_once(extra: dict[str, object]) -> None:
    untied = planner.count_params(_small(False, **extra))
    tied = planner.count_params(_small(True, **extra))
    assert untied.total - tied.total == 1000 * 64
    assert untied.per_token_active - tied.per_token_active == 1000 * 64
    assert tied.embedding == untied.embedding == 1000 * 64
    assert tied.head == 0
    assert untied.head == 1000 * 64


def test_a_pipelines_last_stage_holds_its_own_copy_of_a_tied_matrix() -> None:
    """Counted once per model, but a pipeline's last stage keeps the tied matrix as its head
    (Megatron-Core's output layer on the last stage, all-reduced with the first stage's
    embedding; DeepSpeed's TiedLayerSpec): its stage holds what an untied head's holds."""
    from headroom.planner.stage import stage_params

    tied, untied = _small(True), _small(False)
    last_tied, last_untied = stage_params(tied, 1, 2, 1, 1), stage_params(untied, 1, 2, 1, 1)
    assert last_tied.dense_numel == last_untied.dense_numel
    assert last_tied.head_unit_numel == last_untied.head_unit_numel == 64 + 1000 * 64
    assert stage_params(tied, 1, 2, 1, 0).embedding_numel == 1000 * 64
    one = stage_params(tied, 1, 1, 1, 0)  # one stage: the matrix once, embedding and head
    assert one.dense_numel == planner.count_params(tied).total
    assert one.head_unit_numel == 64 and one.tied_embeddings


def test_small_dense_count_by_hand() -> None:
    # embed 1000x64, per layer: 2 norms, q 64x64, k/v 32x64 each, o 64x64, swiglu 3x 64x192;
    # final norm, head 1000x64.
    per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 192
    expected = 1000 * 64 + 2 * per_layer + 64 + 1000 * 64
    assert planner.count_params(_small(False)).total == expected


@pytest.mark.parametrize("model_type", ["gpt2", "bert", None])
def test_unsupported_model_type(model_type: str | None) -> None:
    data = json.loads((HF_DIR / "llama-3-8b.json").read_text())
    data["model_type"] = model_type
    with pytest.raises(planner.SpecError) as info:
        planner.load_model(data)
    message = str(info.value)
    assert "model_type" in message
    for allowed in SUPPORTED_MODEL_TYPES:
        assert allowed in message
    assert info.value.field == "model_type"


def test_query_and_key_norms_save_their_inputs() -> None:
    """Textbook: each layer's per-head Q/K norms keep their inputs, (heads + kv) x head_dim
    16-bit values per token, in every phase that holds the layers' activations."""
    qwen3 = planner.load_model("qwen3-8b")
    train = planner.TrainSpec(micro_batch_size=2, seq_len=1024)
    hw = planner.gpu("H200-141GB")
    with_norms = planner.estimate(qwen3, train, hw).gpu.phases["forward"].buckets
    without = planner.estimate(qwen3.model_copy(update={"qk_norm": False}), train, hw)
    per_layer = 2 * 1024 * (qwen3.num_heads + qwen3.kv_heads) * qwen3.dim_per_head * 2
    extra = with_norms["activations"] - without.gpu.phases["forward"].buckets["activations"]
    assert extra == qwen3.num_layers * per_layer
