"""Hugging Face transformers models for CPU traces (the ``hf`` activation profile).

``transformers`` is an optional extra (``pip install headroom-planner[hf]``). A model is built
from a ``config.json``-style dict with random weights (nothing is downloaded): either the dict a
user gives, or the one :func:`config_for` writes for a ModelSpec (llama, qwen2 or, with query/key
norms, qwen3 for dense models; mixtral, qwen2_moe or qwen3_moe for MoE models; deepseek_v3 for
multi-head latent attention). Either way the
planner estimates the spec ``planner.hf.from_hf_config`` reads from that same dict, so
prediction and trace describe one model.

The model runs as a training script would: train mode, ``use_cache=False``, SDPA attention, the
loss computed by the model from ``labels`` (transformers upcasts the logits to fp32 for it), and
transformers' default experts implementation (``grouped_mm``), whose shapes do not depend on
the routing, so MoE models trace under fake tensors too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from headroom import planner
from headroom.planner.errors import SpecError
from headroom.planner.hf import SUPPORTED_MODEL_TYPES, from_hf_config

#: the architectures a spec is mapped to
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
#: the architectures a trace also builds from a user's (or a bundled) config.json, which no
#: spec is mapped to: every type the planner reads that transformers builds as a causal LM on
#: its own (not DeepSeek-V2's remote code, InternLM2's, nor Gemma 3's multimodal model)
CONFIG_ARCHITECTURES = (
    *ARCHITECTURES,
    *(
        t
        for t in SUPPORTED_MODEL_TYPES
        if t not in ARCHITECTURES and t not in ("deepseek_v2", "internlm2", "gemma3")
    ),
)
#: config keys every built model gets (a training run's settings, not the architecture's)
TRAINING_KEYS: dict[str, Any] = {"use_cache": False, "attention_dropout": 0.0}


@contextlib.contextmanager
def causal_masks_as_in_a_real_run() -> Iterator[None]:
    """transformers' causal masks under fake tensors as on real ones.

    With real tensors, one sequence per row and no padding, transformers passes SDPA no mask
    and ``is_causal=True`` (so SDPA takes grouped keys and values and runs a fused kernel): it
    reads the position ids, finds no packed sequences and skips the mask. Under fake tensors it
    cannot read them, assumes packing, keeps an explicit causal mask and repeats grouped keys
    and values per query head: memory a real run does not hold. A trace's position ids are
    ``0 .. seq_len - 1`` in every row (it passes none), so for its duration the packed-sequence
    detection answers what it answers on real tensors: none."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - no transformers, nothing to adjust
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers without packed-sequence detection
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def require_transformers() -> Any:
    """The ``transformers`` module, or a SpecError naming ``impl`` when it is not installed."""
    try:
        import transformers
    except ImportError:
        raise SpecError(
            "impl: hf needs the transformers package; install the extra with "
            "pip install 'headroom-planner[hf]', or use --impl runtime",
            field="impl",
        ) from None
    return transformers


def _refuse(field: str, why: str) -> SpecError:
    return SpecError(
        f"model.{field}: an hf trace builds {', '.join(ARCHITECTURES)} models; {why}",
        field=f"model.{field}",
    )


def config_for(spec: planner.ModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of the transformers architecture that has ``spec``'s shape."""
    if spec.ffn_kind != "swiglu":
        raise _refuse("ffn_kind", "their MLPs are SwiGLU (allowed: swiglu)")
    if spec.norm != "rmsnorm":
        raise _refuse("norm", "their norms are RMSNorm (allowed: rmsnorm)")
    if spec.linear_bias or spec.dropout or spec.num_mtp_layers:
        field = (
            "linear_bias" if spec.linear_bias else "dropout" if spec.dropout else "num_mtp_layers"
        )
        raise _refuse(field, "set it to false/0")
    config: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads or spec.num_heads,
        "head_dim": spec.head_dim or spec.hidden_size // spec.num_heads,
        "intermediate_size": spec.ffn_hidden_size,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "_name_or_path": spec.name,
    }
    moe = spec.moe
    if spec.mla is not None:
        return _deepseek_v3(spec, config)
    # llama's and qwen3's attention_bias: Q, K, V and the output projection; qwen2's: Q, K, V
    qwen2 = spec.qkv_bias and not spec.attention_out_bias and not spec.mlp_bias
    if spec.sliding_window is not None and spec.global_attention_every is None:
        # a window over every layer: Mistral's (no biases, no query/key norms)
        config.update(model_type="mistral", sliding_window=spec.sliding_window)
        if moe is None and not spec.qk_norm:
            return _checked(spec, config)
    if moe is None:
        if spec.qk_norm:
            config.update(model_type="qwen3", attention_bias=spec.qkv_bias)
        elif qwen2:
            config["model_type"] = "qwen2"
        else:
            config.update(model_type="llama", attention_bias=spec.qkv_bias, mlp_bias=spec.mlp_bias)
        return _checked(spec, config)
    if moe.router_bias:
        raise _refuse("moe.router_bias", "router biases are DeepSeek's")
    qwen_moe = {  # qwen2_moe's and qwen3_moe's
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_ffn_size,
        "decoder_sparse_step": moe.layer_freq,
        "mlp_only_layers": list(moe.dense_layers),
    }
    if spec.qk_norm:
        if moe.num_shared_experts:
            raise _refuse("moe.num_shared_experts", "qwen3_moe has no shared experts (allowed: 0)")
        config.update(
            qwen_moe, model_type="qwen3_moe", attention_bias=spec.qkv_bias, norm_topk_prob=True
        )
        return _checked(spec, config)
    if moe.num_shared_experts == 0:
        config.update(
            model_type="mixtral",
            intermediate_size=moe.expert_ffn_size,
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
        )
        return _checked(spec, config)
    config.update(
        qwen_moe,
        model_type="qwen2_moe",
        qkv_bias=spec.qkv_bias,
        shared_expert_intermediate_size=moe.shared_expert_ffn_size or moe.expert_ffn_size,
        norm_topk_prob=False,
    )
    return _checked(spec, config)


def _deepseek_v3(spec: planner.ModelSpec, config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's ``config.json`` for a spec with multi-head latent attention: routing over
    one group (the planner does not model group-limited routing; it changes no shape), and
    every layer dense when the spec has no MoE."""
    mla, moe = spec.mla, spec.moe
    assert mla is not None
    config.update(
        model_type="deepseek_v3",
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        attention_bias=False,
        num_nextn_predict_layers=0,
    )
    del config["head_dim"]
    if moe is None:
        config.update(first_k_dense_replace=spec.num_layers, n_routed_experts=0)
        return _checked(spec, config)
    config.update(
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.expert_ffn_size,
        n_shared_experts=moe.num_shared_experts,
        first_k_dense_replace=moe.dense_first_layers,
        moe_layer_freq=moe.layer_freq,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        # the planner reads a router bias from noaux_tc; transformers keeps one either way
        topk_method="noaux_tc" if moe.router_bias else "greedy",
    )
    return _checked(spec, config)


#: fields that describe a spec, not its shape
_NOT_SHAPE = ("name", "source")


def _checked(spec: planner.ModelSpec, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` if the planner reads it back as ``spec``; else a SpecError naming the first
    field the architecture cannot express."""
    want = spec.model_dump(exclude=set(_NOT_SHAPE))
    got = from_hf_config(config).model_dump(exclude=set(_NOT_SHAPE))
    if want.get("head_dim") is None:
        got["head_dim"] = None  # the default width, written out
    if want.get("num_kv_heads") is None and got["num_kv_heads"] == want["num_heads"]:
        got["num_kv_heads"] = None  # as many as the query heads, written out
    w_moe, g_moe = want["moe"], got["moe"]
    if (
        w_moe
        and g_moe
        and w_moe["shared_expert_ffn_size"] is None
        and g_moe["shared_expert_ffn_size"] == w_moe["expert_ffn_size"]
    ):
        g_moe["shared_expert_ffn_size"] = None  # the default width, written out
    for key, value in want.items():
        if key == "moe" and value is not None and got["moe"] is not None:
            for sub, v in value.items():
                if got["moe"][sub] != v:
                    raise _refuse(
                        f"moe.{sub}",
                        f"{config['model_type']} cannot express {sub}={v!r} "
                        f"(it would be {got['moe'][sub]!r})",
                    )
        elif got[key] != value:
            raise _refuse(
                key,
                f"{config['model_type']} cannot express {key}={value!r} (it would be {got[key]!r})",
            )
    return config


def spec_of(config: Mapping[str, Any]) -> planner.ModelSpec:
    """The planner's reading of a ``config.json`` dict (one of :data:`ARCHITECTURES`)."""
    model_type = config.get("model_type")
    if model_type not in CONFIG_ARCHITECTURES:
        raise SpecError(
            f"model_type: an hf trace builds {', '.join(CONFIG_ARCHITECTURES)}; got {model_type!r}",
            field="model_type",
        )
    return from_hf_config(config)


def build(config: Mapping[str, Any]) -> Any:
    """A transformers causal LM of ``config`` with random weights, in the current default
    dtype and device mode (call it under ``FakeTensorMode`` to allocate nothing)."""
    transformers = require_transformers()
    spec_of(config)
    fields = {k: v for k, v in config.items() if k not in ("model_type", "_name_or_path")}
    try:
        hf_config = transformers.AutoConfig.for_model(str(config["model_type"]), **fields)
        for key, value in TRAINING_KEYS.items():
            setattr(hf_config, key, value)
        net = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        # a value the planner has no opinion on (RoPE scaling, say) that transformers refuses
        raise SpecError(
            f"config.json: transformers cannot build it ({type(exc).__name__}: {exc})",
            field="config",
        ) from None
    return net.train()
