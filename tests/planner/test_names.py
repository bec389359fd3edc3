"""Names as people type them: preset names of every kind are case-insensitive, and an unknown
name or key names the closest known one and every known one."""

from __future__ import annotations

import pytest

from headroom import planner
from headroom.planner.cluster import cluster_preset
from headroom.planner.errors import did_you_mean


@pytest.mark.parametrize("typed", ["Llama-3-8B", "LLAMA-3-8B", " llama-3-8b "])
def test_a_model_preset_is_found_whatever_its_case(typed: str) -> None:
    assert planner.load_model(typed) is planner.load_model("llama-3-8b")


def test_a_run_preset_is_found_whatever_its_case() -> None:
    assert planner.load_train("TorchTitan-Llama3-8B") == planner.load_train("torchtitan-llama3-8b")


@pytest.mark.parametrize(
    ("load", "typed", "closest"),
    [
        (planner.load_model, "llama-3-8", "'llama-3-8b'"),
        (planner.load_model, "mixtral-8x7", "'mixtral-8x7b'"),
        (planner.gpu, "h100-80", "'H100-80GB'"),  # the canonical name, not the alias matched
        (cluster_preset, "dgx-h10", "'DGX-H100'"),
        (planner.load_train, "torchtitan-llama3-8", "'torchtitan-llama3-8b'"),
    ],
)
def test_an_unknown_name_names_the_closest_and_every_known_one(
    load: object, typed: str, closest: str
) -> None:
    with pytest.raises(planner.UnknownPresetError) as info:
        load(typed)  # type: ignore[operator]
    message = str(info.value)
    assert f"(did you mean {closest}?)" in message
    assert closest.strip("'") in message.split("(did you mean", 1)[1].split(";", 1)[1]


def test_a_name_like_nothing_known_gets_the_list_without_a_guess() -> None:
    with pytest.raises(planner.UnknownPresetError) as info:
        planner.gpu("zzzzzz")
    assert "did you mean" not in str(info.value) and "H100-80GB" in str(info.value)
    assert did_you_mean("zzzzzz", ["a100", "h100"]) == ""


@pytest.mark.parametrize(
    ("override", "path", "closest", "known"),
    [
        ({"micro_batch": 4}, "train.micro_batch", "micro_batch_size", "grad_accum_steps"),
        ({"parallel": {"tpp": 2}}, "train.parallel.tpp", "tp", "zero_stage"),
        ({"offload": {"fractoin": 0.5}}, "train.offload.fractoin", "fraction", "num_buffers"),
    ],
)
def test_an_unknown_key_names_the_closest_and_the_known_keys_where_it_is(
    override: dict[str, object], path: str, closest: str, known: str
) -> None:
    with pytest.raises(planner.SpecError) as info:
        planner.load_train(override)
    message = str(info.value)
    assert message.startswith(f"{path}: unknown field (did you mean {closest!r}?); allowed: ")
    assert known in message


def test_an_unknown_key_in_a_model_file_is_named_the_same_way() -> None:
    with pytest.raises(planner.SpecError) as info:
        planner.load_model({"name": "m", "num_layer": 2})
    assert "model.num_layer: unknown field (did you mean 'num_layers'?)" in str(info.value)


def test_a_config_json_without_model_type_is_one_line_naming_the_types() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 32000,
    }
    with pytest.raises(planner.SpecError) as info:
        planner.load_model(config)
    message = str(info.value)
    assert message.startswith("model_type: a Hugging Face config.json (it has architectures")
    assert "llama" in message and "deepseek_v3" in message and ";" not in message.split(";")[0]
    assert message.count("Field required") == 0 and info.value.field == "model_type"


def test_the_model_schema_document_names_every_field() -> None:
    """docs/MODEL_SCHEMA.md documents every field of ModelSpec, MoESpec and MLASpec."""
    from pathlib import Path

    from headroom.planner.model import MLASpec, ModelSpec, MoESpec

    doc = (Path(__file__).resolve().parents[2] / "docs" / "MODEL_SCHEMA.md").read_text()
    for cls in (ModelSpec, MoESpec, MLASpec):
        for name in cls.model_fields:
            assert f"| `{name}` |" in doc, (cls.__name__, name)
    # the example in it is a valid model
    import json
    import re

    (example,) = re.findall(r"```json\n(.*?)```", doc, re.S)
    assert planner.load_model(json.loads(example)).moe is not None
