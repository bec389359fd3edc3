"""Read Hugging Face ``config.json`` files offline into a ModelSpec.

Recognised by ``model_type``: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
deepseek_v3 (and deepseek_v2, which shares the layout), gemma, gemma2, gemma3 (its language
model) and gemma3_text, phi3, olmo, olmo2, starcoder2, granite, cohere, cohere2 and internlm2.
Where a config leaves a key out, the family's config class's default is read (its
``tie_word_embeddings`` above all). Nothing is downloaded; only the JSON is read.
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


def _float(config: Mapping[str, Any], key: str, default: float) -> float:
    """A number field (absent or null: ``default``; a bool or text is no number)."""
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"config.json: {key} must be a number, got {_show(value)}", field=key)
    return float(value)


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


def _ffn_kind(config: Mapping[str, Any], gelu: bool = False, gated_gelu: bool = False) -> str:
    """The MLP's kind from its activation (``hidden_act``, or Gemma's ``hidden_activation``;
    absent: the family's, GELU where ``gelu``, else SiLU): SiLU gates a SwiGLU MLP; GELU gates
    Gemma's (``gated_gelu``) and is a two-matrix MLP's elsewhere."""
    default = "gelu_pytorch_tanh" if gelu or gated_gelu else "silu"
    given = {key: _get(config, key) for key in ("hidden_activation", "hidden_act")}
    for key, act in given.items():  # each one given is an activation, read or not
        if act is not None and not (
            isinstance(act, str) and (act in ("silu", "swish") or act.startswith("gelu"))
        ):
            raise SpecError(
                f"config.json: {key} must be silu, swish or gelu*, got {_show(act)}", field=key
            )
    act = given["hidden_activation"] or given["hidden_act"] or default
    if act in ("silu", "swish"):
        return "swiglu"
    return "geglu" if gated_gelu else "gelu"


#: the attention kinds ``layer_types`` may list, and how many layers it may list
LAYER_TYPES = ("sliding_attention", "full_attention")
_MAX_LAYER_TYPES = 4096
#: the widest window a spec takes (``ModelSpec.sliding_window``)
_MAX_WINDOW = 2**28


def _layer_types(config: Mapping[str, Any]) -> list[str] | None:
    """``layer_types``, each ``sliding_attention`` or ``full_attention`` (absent: None)."""
    types = _get(config, "layer_types")
    if types is None:
        return None
    if (
        not isinstance(types, list | tuple)
        or len(types) > _MAX_LAYER_TYPES
        or not all(kind in LAYER_TYPES for kind in types)
    ):
        raise SpecError(
            f"config.json: layer_types must be a list of at most {_MAX_LAYER_TYPES} of "
            f"{', '.join(LAYER_TYPES)}, got {_show(types)}",
            field="layer_types",
        )
    return list(types)


def _pattern(config: Mapping[str, Any], default: int) -> int:
    """``sliding_window_pattern``: one global layer in this many (1 to 4096)."""
    every = _int(config, "sliding_window_pattern", default)
    if not 1 <= every <= _MAX_LAYER_TYPES:
        raise SpecError(
            f"config.json: sliding_window_pattern must be between 1 and {_MAX_LAYER_TYPES}, "
            f"got {every}",
            field="sliding_window_pattern",
        )
    return every


def _sliding(config: Mapping[str, Any], every: int | None) -> dict[str, Any]:
    """The sliding window and which layers attend globally: from ``layer_types`` where the
    config lists them (transformers 4.53 and later), else every ``every``-th layer (None: every
    layer slides)."""
    window = _optional_int(config, "sliding_window")
    if window is not None and not 1 <= window <= _MAX_WINDOW:
        raise SpecError(
            f"config.json: sliding_window must be between 1 and {_MAX_WINDOW}, got {window}",
            field="sliding_window",
        )
    types = _layer_types(config)
    if window is None:
        return {}
    if types is not None:
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        if len(full) == len(types):
            return {}
        every = full[0] + 1 if full else None
        if every is not None and any(
            (kind == "full_attention") != ((i + 1) % every == 0) for i, kind in enumerate(types)
        ):
            raise SpecError(
                "config.json: layer_types must repeat one pattern (every k-th layer "
                f"full_attention, the rest sliding_attention), got {_show(types)}",
                field="layer_types",
            )
    return {"sliding_window": window, "global_attention_every": every}


def _common(
    config: Mapping[str, Any],
    name: str,
    *,
    tied: bool = False,
    gelu: bool = False,
    gated_gelu: bool = False,
) -> dict[str, Any]:
    """The fields every family reads alike; ``tied``, ``gelu``: the family's defaults for
    ``tie_word_embeddings`` and the activation (its config class's)."""
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
        "ffn_kind": _ffn_kind(config, gelu, gated_gelu),
        "norm": "rmsnorm",
        "tied_embeddings": _bool(config, "tie_word_embeddings", tied),
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
    # no biases, whatever the config says; v0.1's window slides over every layer
    return _common(config, name) | _sliding(config, None)


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


def _gemma(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Gemma: a GeGLU MLP, 256-wide heads, the embedding tied to the head."""
    return _attention_bias(_common(config, name, tied=True, gated_gelu=True), config)


def _softcaps(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma's tanh soft-caps of the attention scores and the logits (null: none)."""
    return {
        "attn_logit_softcap": _get(config, "attn_logit_softcapping"),
        "final_logit_softcap": _get(config, "final_logit_softcapping"),
    }


def _gemma2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Gemma 2: Gemma with a norm before and after attention and the MLP, every other layer
    sliding (from the first), and tanh soft-capping of the scores and the logits."""
    spec = _gemma(config, name)
    spec["norm_placement"] = "sandwich"
    spec.update(_sliding(config, 2))
    spec.update(_softcaps(config))
    return spec


#: Gemma3TextConfig's defaults for the keys read here: the multimodal configs (model_type
#: gemma3) leave much of their text_config to them (a test holds them to transformers')
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attention_bias": False,
    "tie_word_embeddings": True,
}


def _gemma3_text(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Gemma 3's language model: Gemma 2's sandwich norms with query/key norms, five sliding
    layers to one global one, no soft-capping."""
    config = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    spec = _gemma(config, name)
    spec.update(norm_placement="sandwich", qk_norm=True)
    spec.update(_sliding(config, _pattern(config, 6)))
    spec.update(_softcaps(config))
    return spec


def _gemma3(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A multimodal Gemma 3 config: its language model (``text_config``); the vision tower
    and its projector are not priced, which the spec's source says."""
    text = _get(config, "text_config", {})
    if not isinstance(text, Mapping):
        raise SpecError(
            f"config.json: text_config must be an object, got {_show(text)}", field="text_config"
        )
    return _gemma3_text(text, name)


def _phi3(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Phi-3: Llama's shape with fused Q/K/V and gate/up projections (the same weights), and
    a window over every layer where the config sets one."""
    return _common(config, name) | _sliding(config, None)


def _olmo(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """OLMo: LayerNorms that learn nothing (no weight, no bias)."""
    spec = _attention_bias(_common(config, name), config)
    spec.update(norm="layernorm", norm_params="none")
    return spec


def _olmo2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """OLMo 2: RMSNorms after attention and the MLP (none before), and query/key norms over
    all heads at once (a weight per head's width)."""
    spec = _attention_bias(_common(config, name), config)
    spec.update(norm_placement="post", qk_norm=True, qk_norm_weights="per_head")
    return spec


def _starcoder2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """StarCoder2: LayerNorms with biases, a two-matrix GELU MLP, every linear biased
    (``use_bias``), dropout, and a window over every layer."""
    spec = _common(config, name, tied=True, gelu=True)
    dropout = False
    for key in ("residual_dropout", "embedding_dropout", "attention_dropout"):
        p = _float(config, key, 0.0)
        if not 0 <= p <= 1:
            raise SpecError(f"config.json: {key} must be between 0 and 1, got {p}", field=key)
        dropout = dropout or p > 0
    spec.update(
        norm="layernorm",
        linear_bias=_bool(config, "use_bias", True),
        dropout=dropout,
    )
    spec.update(_sliding(config, None))
    return spec


def _cohere(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Cohere (Command R): one LayerNorm without a bias before attention and the MLP, which
    run side by side on its output; per-head query/key norms where ``use_qk_norm``."""
    spec = _attention_bias(_common(config, name, tied=True), config)
    qk_norm = _bool(config, "use_qk_norm", False)
    spec.update(norm="layernorm", norm_params="weight", norm_placement="parallel")
    if qk_norm:
        spec.update(qk_norm=True, qk_norm_weights="per_head")
    return spec


def _cohere2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Cohere 2 (Command R7B): Cohere's parallel block, three sliding layers to one global."""
    spec = _cohere(config, name)
    spec.update(_sliding(config, _pattern(config, 4)))
    return spec


def _internlm2(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """InternLM2 (its own modeling code, ``trust_remote_code``): Llama's shape with the Q/K/V
    projection fused (``wqkv``), and ``bias`` on it and the output projection only."""
    spec = _common(config, name)
    bias = _bool(config, "bias", True)  # InternLM2Config's default
    spec.update(qkv_bias=bias, attention_out_bias=bias)
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
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo": _olmo,
    "olmo2": _olmo2,
    "starcoder2": _starcoder2,
    "granite": _llama,  # Llama's weights; its multipliers scale, they add no tensor
    "cohere": _cohere,
    "cohere2": _cohere2,
    "internlm2": _internlm2,
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
    if model_type == "gemma3":
        fields["source"] += ": its text_config; the vision tower is not priced"
    return ModelSpec(**fields)
