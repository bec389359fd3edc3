"""The forms a request may give a model, a GPU, a cluster, a training spec and a host size in,
as the OpenAPI document describes them.

The bodies keep taking what they took (a preset name or an object, checked by the planner);
these types only say precisely what that is, so generated clients and fuzzers send requests the
handlers work on instead of strings that name nothing: the bundled presets by name (an enum),
our model spec, a Hugging Face ``config.json`` of a supported ``model_type``, a hardware object,
a cluster object (its GPU a preset), the training spec, and a host size as bytes or text. What
a JSON Schema cannot say (that ``num_kv_heads`` divides ``num_heads``, that a layout splits the
model evenly, that a run is predicted to fit) the planner still refuses with a 422 naming the
field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
)

from headroom import planner
from headroom.planner.hardware import MAX_HOST_MEMORY_BYTES

#: a model preset's name (``GET /presets``)
ModelPreset = Literal[tuple(planner.model_names())]  # type: ignore[valid-type]
#: a GPU preset's name or alias (``GET /presets``; matched ignoring case)
GpuPreset = Literal[  # type: ignore[valid-type]
    tuple(
        sorted(
            {
                name
                for hw in map(planner.gpu, planner.gpu_names())
                for name in (hw.name, *hw.aliases)
            }
        )
    )
]

#: a cluster preset's name or alias (``headroom plan --cluster``; matched ignoring case)
ClusterPreset = Literal[  # type: ignore[valid-type]
    tuple(
        sorted(
            {
                name
                for cluster in map(planner.cluster.cluster_preset, planner.cluster_names())
                for name in (cluster.name, *cluster.aliases)
            }
        )
    )
]

# the bounds ModelSpec puts on what a config.json's keys become (a test holds them equal)
_SIZE = Annotated[int, Field(ge=1, le=2**24)]
_COUNT = Annotated[int, Field(ge=1, le=2**20)]
_LAYERS = Annotated[int, Field(ge=1, le=4096)]


class _HFConfig(BaseModel):
    """A Hugging Face ``config.json``: the keys Headroom reads for its ``model_type`` (any others
    are ignored; a key given as null counts as absent)."""

    model_config = ConfigDict(extra="allow")

    vocab_size: _SIZE
    hidden_size: _SIZE
    num_hidden_layers: _LAYERS
    num_attention_heads: _COUNT
    num_key_value_heads: _COUNT | None = Field(default=None, description="Default: MHA.")
    head_dim: _SIZE | None = Field(default=None, description="Default: hidden / heads.")
    intermediate_size: _SIZE
    hidden_act: Annotated[str, StringConstraints(pattern=r"^(silu|swish|gelu.*)$")] | None = None
    tie_word_embeddings: StrictBool | None = None


class HFLlamaConfig(_HFConfig):
    """A Llama ``config.json``."""

    model_type: Literal["llama"]
    attention_bias: StrictBool | None = None
    mlp_bias: StrictBool | None = None


class HFMistralConfig(_HFConfig):
    """A Mistral or Qwen2 ``config.json`` (no bias keys read: Qwen2 has Q, K, V biases)."""

    model_type: Literal["mistral", "qwen2"]


class HFQwen3Config(_HFConfig):
    """A Qwen3 ``config.json`` (``head_dim`` defaults to 128)."""

    model_type: Literal["qwen3"]
    attention_bias: StrictBool | None = None


class HFMixtralConfig(_HFConfig):
    """A Mixtral ``config.json``."""

    model_type: Literal["mixtral"]
    num_local_experts: _COUNT
    num_experts_per_tok: _COUNT


class _HFQwenMoEConfig(_HFConfig):
    num_experts: _COUNT
    num_experts_per_tok: _COUNT
    moe_intermediate_size: _SIZE
    decoder_sparse_step: Annotated[int, Field(ge=1, le=4096)] | None = None
    mlp_only_layers: list[Annotated[int, Field(ge=0, lt=4096)]] | None = Field(
        default=None, max_length=4096
    )


class HFQwen2MoEConfig(_HFQwenMoEConfig):
    """A Qwen2-MoE ``config.json``."""

    model_type: Literal["qwen2_moe"]
    shared_expert_intermediate_size: Annotated[int, Field(ge=0, le=2**24)] | None = None
    qkv_bias: StrictBool | None = None


class HFQwen3MoEConfig(_HFQwenMoEConfig):
    """A Qwen3-MoE ``config.json``."""

    model_type: Literal["qwen3_moe"]
    attention_bias: StrictBool | None = None


class _HFDeepSeekConfig(_HFConfig):
    # MLA: every head has its own K and V, whatever these say (they are read, not bounded)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    model_type: Literal["deepseek_v2", "deepseek_v3"]
    q_lora_rank: _SIZE | None = None
    kv_lora_rank: _SIZE
    qk_nope_head_dim: _SIZE
    qk_rope_head_dim: Annotated[int, Field(ge=0, le=2**24)]
    v_head_dim: _SIZE
    num_nextn_predict_layers: Annotated[int, Field(ge=0, le=4096)] | None = None


class HFDeepSeekConfig(_HFDeepSeekConfig):
    """A dense DeepSeek-V2 or -V3 ``config.json`` (no routed experts: the MoE keys are not
    read)."""

    n_routed_experts: Literal[0] | None = None


class HFDeepSeekMoEConfig(_HFDeepSeekConfig):
    """A DeepSeek-V2 or -V3 ``config.json`` with routed experts."""

    n_routed_experts: _COUNT
    num_experts_per_tok: _COUNT
    moe_intermediate_size: _SIZE
    n_shared_experts: Annotated[int, Field(ge=0, le=2**20)] | None = None
    first_k_dense_replace: Annotated[int, Field(ge=0, le=4096)] | None = None
    moe_layer_freq: Annotated[int, Field(ge=1, le=4096)] | None = None
    topk_method: Any = Field(default=None, description="noaux_tc: a per-expert routing bias.")


#: a config.json of each supported model_type, as its reader in ``planner.hf`` takes it
HFConfig = (
    HFLlamaConfig
    | HFMistralConfig
    | HFQwen3Config
    | HFMixtralConfig
    | HFQwen2MoEConfig
    | HFQwen3MoEConfig
    | HFDeepSeekConfig
    | HFDeepSeekMoEConfig
)

#: a size the planner reads (``planner.parse_size``): a number above zero, optionally with an
#: exponent, and a unit of B, KB, MB, GB, TB (10^3) or KiB, MiB, GiB, TiB (2^10; K, M, G, T
#: too), in any case; what it comes to must be 1 byte to 1 PiB
SIZE_PATTERN = (
    r"^\s*(?:0*[1-9][0-9]*(?:\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)(?:[eE][+-]?[0-9]+)?"
    r"\s*(?:[bB]|[kKmMgGtT](?:[iI]?[bB])?)?\s*$"
)
SizeText = Annotated[str, StringConstraints(max_length=64, pattern=SIZE_PATTERN)]
#: host RAM per node: 1 byte to 1 PiB
HostBytes = Annotated[int, Field(ge=1, le=MAX_HOST_MEMORY_BYTES)]


def documented_as(schema_type: Any) -> BeforeValidator:
    """Describe a field as ``schema_type`` in the OpenAPI; its value is checked as before."""
    return BeforeValidator(lambda value: value, json_schema_input_type=schema_type)


def _gpu_preset(name: str) -> str:
    try:
        planner.gpu(name)
    except planner.UnknownPresetError:
        allowed = ", ".join(planner.gpu_names())
        raise ValueError(f"unknown GPU preset {name[:100]!r}; allowed: {allowed}") from None
    return name


class Cluster(planner.Cluster):
    """Nodes of ``gpus_per_node`` GPUs and the links a parallel layout's collectives cross."""

    # a request's cluster object: its GPU is one of the presets (any case), as its schema says
    gpu: Annotated[
        str, Field(max_length=100), documented_as(GpuPreset), AfterValidator(_gpu_preset)
    ] = Field(description="The GPU preset of its nodes, by name or alias (GET /presets; any case).")


#: how each body's ``model``, ``gpu``, ``cluster``, ``train`` and ``host_memory`` are taken and
#: described
ModelInput = Annotated[
    str | dict[str, Any], documented_as(ModelPreset | planner.ModelSpec | HFConfig)
]
GpuInput = Annotated[str | dict[str, Any], documented_as(GpuPreset | planner.Hardware)]
ClusterInput = Annotated[str | Cluster | None, documented_as(ClusterPreset | Cluster | None)]
TrainInput = Annotated[dict[str, Any] | None, documented_as(planner.TrainSpec | None)]
HostMemoryInput = Annotated[str | int | None, documented_as(SizeText | HostBytes | None)]
