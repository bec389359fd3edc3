"""Read Hugging Face ``config.json`` files offline into a ModelSpec.

Recognised by ``model_type``: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
deepseek_v3 (and deepseek_v2, which shares the layout). Nothing is downloaded; only the JSON is
read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from headroom.planner.errors import SpecError
from headroom.planner.model import MLASpec, ModelSpec, MoESpec


def _get(
    config: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False
) -> Any:
    if key in config and config[key] is not None:
        return config[key]
    if required:
        raise SpecError(
            f"config.json ({config.get('model_type')}): missing required field '{key}'", field=key
        )
    return default


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    """An integer field (``3`` or ``"3"``; not a bool, a float or anything else)."""
    value = _get(config, key, default)
    digits = isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*", value)
    integral = isinstance(value, float) and value.is_integer() and abs(value) <= 2**53
    if digits or integral:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"config.json: {key} must be an integer, got {_show(value)}", field=key)
    return value


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean field (absent or null: ``default``); ``1`` or ``"true"`` is no boolean."""
    value = _get(config, key, default)
    if not isinstance(value, bool):
        raise SpecError(f"config.json: {key} must be true or false, got {_show(value)}", field=key)
    return value


def _required_int(config: Mapping[str, Any], key: str) -> int:
    """A required integer field: ``num_hidden_layers: true`` is no 1-layer model."""
    _get(config, key, required=True)
    return _int(config, key, 0)


def _optional_int(config: Mapping[str, Any], key: str) -> int | None:
    """An integer field that may be absent or null."""
    return None if _get(config, key) is None else _int(config, key, 0)


def _ints(config: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """A list of integers (absent or null: empty)."""
    value = _get(config, key, [])
    if not isinstance(value, list | tuple) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise SpecError(
            f"config.json: {key} must be a list of integers, got {_show(value)}", field=key
        )
    return tuple(value)


def _ffn_kind(config: Mapping[str, Any]) -> str:
    act = str(_get(config, "hidden_act", "silu"))
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "gelu"
    raise SpecError(
        f"config.json: hidden_act must be silu or gelu*, got {act!r}", field="hidden_act"
    )


def _common(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    heads = _required_int(config, "num_attention_heads")
    return {
        "name": name,
        "vocab_size": _required_int(config, "vocab_size"),
        "hidden_size": _required_int(config, "hidden_size"),
        "num_layers": _required_int(config, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": _int(config, "num_key_value_heads", heads),
        "head_dim": _optional_int(config, "head_dim"),
        "ffn_hidden_size": _required_int(config, "intermediate_size"),
        "ffn_kind": _ffn_kind(config),
        "norm": "rmsnorm",
        "tied_embeddings": _bool(config, "tie_word_embeddings", False),
    }


def _attention_bias(spec: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's and Qwen3's ``attention_bias``: biases on Q, K, V and the output projection."""
    bias = _bool(config, "attention_bias", False)
    spec.update(qkv_bias=bias, attention_out_bias=bias)
    return spec


def _llama(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _attention_bias(_common(config, name), config)
    spec["mlp_bias"] = _bool(config, "mlp_bias", False)
    return spec


def _mistral(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _common(config, name)  # no biases, whatever the config says


def _mixtral(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _common(config, name)
    spec["moe"] = MoESpec(
        num_experts=_required_int(config, "num_local_experts"),
        top_k=_required_int(config, "num_experts_per_tok"),
        expert_ffn_size=spec["ffn_hidden_size"],
    )
    return spec


def _qwen2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _common(config, name)
    spec["qkv_bias"] = True
    return spec


def _qwen_moe(config: Mapping[str, Any], **shared: Any) -> MoESpec:
    """The routed experts and the MoE layers' placement of Qwen2-MoE and Qwen3-MoE configs
    (every ``decoder_sparse_step``-th layer, ``mlp_only_layers`` forced dense)."""
    step = _int(config, "decoder_sparse_step", 1)
    return MoESpec(
        num_experts=_required_int(config, "num_experts"),
        top_k=_required_int(config, "num_experts_per_tok"),
        expert_ffn_size=_required_int(config, "moe_intermediate_size"),
        dense_first_layers=step - 1,
        layer_freq=step,
        dense_layers=_ints(config, "mlp_only_layers"),
        **shared,
    )


def _qwen2_moe(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _common(config, name)
    spec["qkv_bias"] = _bool(config, "qkv_bias", True)  # Qwen2MoeConfig's, default on
    shared = _int(config, "shared_expert_intermediate_size", 0)
    spec["moe"] = _qwen_moe(
        config,
        num_shared_experts=1 if shared else 0,
        shared_expert_ffn_size=shared or None,
        shared_expert_gate=bool(shared),
    )
    return spec


def _qwen3(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _attention_bias(_common(config, name), config)
    spec["qk_norm"] = True
    spec["head_dim"] = _int(config, "head_dim", 128)  # Qwen3Config's default, whatever the width
    return spec


def _qwen3_moe(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    # Qwen3MoeConfig has no head_dim default: hidden / heads
    spec = _attention_bias(_common(config, name), config)
    spec["qk_norm"] = True
    spec["moe"] = _qwen_moe(config)
    return spec


def _deepseek(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    spec = _common(config, name)
    spec["num_kv_heads"] = spec["num_heads"]
    spec["head_dim"] = None
    spec["mla"] = MLASpec(
        q_lora_rank=_optional_int(config, "q_lora_rank"),
        kv_lora_rank=_required_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_required_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_required_int(config, "qk_rope_head_dim"),
        v_head_dim=_required_int(config, "v_head_dim"),
    )
    experts = _optional_int(config, "n_routed_experts")
    if experts:
        spec["moe"] = MoESpec(
            num_experts=experts,
            top_k=_required_int(config, "num_experts_per_tok"),
            expert_ffn_size=_required_int(config, "moe_intermediate_size"),
            num_shared_experts=_int(config, "n_shared_experts", 0),
            dense_first_layers=_int(config, "first_k_dense_replace", 0),
            layer_freq=_int(config, "moe_layer_freq", 1),
            router_bias=_get(config, "topk_method") == "noaux_tc",
            # the gate's scores are fp32 and scale the experts' outputs as they are
            routing_weights_fp32=True,
        )
    spec["num_mtp_layers"] = _int(config, "num_nextn_predict_layers", 0)
    return spec


_READERS: dict[str, Callable[[Mapping[str, Any], str], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_READERS))


def from_hf_config(config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict onto a ModelSpec."""
    model_type = config.get("model_type")
    reader = _READERS.get(str(model_type))
    if reader is None:
        raise SpecError(
            f"model_type: {model_type!r} is not supported; allowed: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
            field="model_type",
        )
    display = name or str(config.get("_name_or_path") or model_type)
    fields = reader(config, display)
    fields["source"] = f"Hugging Face config.json (model_type={model_type})"
    return ModelSpec(**fields)
