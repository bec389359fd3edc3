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

import copy
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from headroom import planner
from headroom.planner.hardware import MAX_HOST_MEMORY_BYTES
from headroom.planner.io import set_key, validation_message
from headroom.planner.stack_configs import KINDS_TEXT, from_texts

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


#: a sliding window's keys, a soft-cap, a dropout probability, the layers' attention kinds
_WINDOW = Annotated[int, Field(ge=1, le=2**28)]
_CAP = Annotated[float, Field(gt=0, le=10_000)]
_DROPOUT = Annotated[float, Field(ge=0, le=1)]
_LAYER_TYPES = Annotated[
    list[Literal["sliding_attention", "full_attention"]], Field(max_length=4096)
]


class HFLlamaConfig(_HFConfig):
    """A Llama or Granite ``config.json`` (Granite's multipliers are not read: they add no
    tensor)."""

    model_type: Literal["llama", "granite"]
    attention_bias: StrictBool | None = None
    mlp_bias: StrictBool | None = None


class HFMistralConfig(_HFConfig):
    """A Mistral or Phi-3 ``config.json``: a window over every layer where ``sliding_window``
    is set."""

    model_type: Literal["mistral", "phi3"]
    sliding_window: _WINDOW | None = None


class HFQwen2Config(_HFConfig):
    """A Qwen2 ``config.json`` (no bias keys read: Qwen2 has Q, K, V biases)."""

    model_type: Literal["qwen2"]


_ACTIVATION = Annotated[str, StringConstraints(pattern=r"^(silu|swish|gelu.*)$")]


class HFGemmaConfig(_HFConfig):
    """A Gemma ``config.json``: a GeGLU MLP (``hidden_activation``, else ``hidden_act``)."""

    model_type: Literal["gemma"]
    hidden_activation: _ACTIVATION | None = None
    attention_bias: StrictBool | None = None


class HFGemma2Config(HFGemmaConfig):
    """A Gemma 2 ``config.json``: Gemma with sandwich norms, every other layer sliding (or as
    ``layer_types`` lists them) and soft-capping."""

    model_type: Literal["gemma2"]  # type: ignore[assignment]
    sliding_window: _WINDOW | None = None
    layer_types: _LAYER_TYPES | None = None
    attn_logit_softcapping: _CAP | None = None
    final_logit_softcapping: _CAP | None = None


class HFGemma3Text(BaseModel):
    """Gemma 3's language model, each key absent taking Gemma3TextConfig's default."""

    model_config = ConfigDict(extra="allow")

    vocab_size: _SIZE | None = None
    hidden_size: _SIZE | None = None
    num_hidden_layers: _LAYERS | None = None
    num_attention_heads: _COUNT | None = None
    num_key_value_heads: _COUNT | None = None
    head_dim: _SIZE | None = None
    intermediate_size: _SIZE | None = None
    hidden_activation: _ACTIVATION | None = None
    hidden_act: _ACTIVATION | None = None
    tie_word_embeddings: StrictBool | None = None
    attention_bias: StrictBool | None = None
    sliding_window: _WINDOW | None = None
    sliding_window_pattern: _LAYERS | None = None
    layer_types: _LAYER_TYPES | None = None
    attn_logit_softcapping: _CAP | None = None
    final_logit_softcapping: _CAP | None = None


class HFGemma3TextConfig(HFGemma3Text):
    """A Gemma 3 text-only ``config.json``: Gemma 2's shape with query/key norms, one global
    layer in ``sliding_window_pattern``."""

    model_type: Literal["gemma3_text"]


class HFGemma3Config(BaseModel):
    """A multimodal Gemma 3 ``config.json``: its language model (``text_config``) is read;
    the vision tower is not priced."""

    model_config = ConfigDict(extra="allow")

    model_type: Literal["gemma3"]
    text_config: HFGemma3Text | None = None


class HFOlmoConfig(_HFConfig):
    """An OLMo (norms that learn nothing) or OLMo 2 (norms after attention and the MLP,
    query/key norms over all heads) ``config.json``."""

    model_type: Literal["olmo", "olmo2"]
    attention_bias: StrictBool | None = None


class HFStarcoder2Config(_HFConfig):
    """A StarCoder2 ``config.json``: LayerNorms with biases, a GeLU MLP, every linear biased
    (``use_bias``), dropout where any of its three is above zero, a window over every layer."""

    model_type: Literal["starcoder2"]
    use_bias: StrictBool | None = None
    residual_dropout: _DROPOUT | None = None
    embedding_dropout: _DROPOUT | None = None
    attention_dropout: _DROPOUT | None = None
    sliding_window: _WINDOW | None = None


class HFCohereConfig(_HFConfig):
    """A Cohere (Command R) ``config.json``: one bias-free LayerNorm before attention and the
    MLP side by side, per-head query/key norms where ``use_qk_norm``."""

    model_type: Literal["cohere"]
    attention_bias: StrictBool | None = None
    use_qk_norm: StrictBool | None = None


class HFCohere2Config(HFCohereConfig):
    """A Cohere 2 (Command R7B) ``config.json``: Cohere's layers, one global in
    ``sliding_window_pattern`` (or as ``layer_types`` lists them)."""

    model_type: Literal["cohere2"]  # type: ignore[assignment]
    sliding_window: _WINDOW | None = None
    sliding_window_pattern: _LAYERS | None = None
    layer_types: _LAYER_TYPES | None = None


class HFInternLM2Config(_HFConfig):
    """An InternLM2 ``config.json`` (``bias``: on the fused Q/K/V and output projections)."""

    model_type: Literal["internlm2"]
    bias: StrictBool | None = None


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
    | HFQwen2Config
    | HFGemmaConfig
    | HFGemma2Config
    | HFGemma3TextConfig
    | HFGemma3Config
    | HFOlmoConfig
    | HFStarcoder2Config
    | HFCohereConfig
    | HFCohere2Config
    | HFInternLM2Config
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


class StackFile(BaseModel):
    """One file of a stack's own training config, as text."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=255,
        description="The file's name, whose suffix says what it is (llama3_8b.toml, "
        "ds_z3_config.json, train.yaml, pretrain_gpt.sh); a file the config names is found by "
        "its base name among the others.",
    )
    text: str = Field(description="The file's text.")


class StackConfigTrain(BaseModel):
    """A stack's own training config as the training spec (``--train llama3_8b.toml``)."""

    model_config = ConfigDict(extra="forbid")

    stack_config: list[StackFile] = Field(
        min_length=1,
        max_length=4,
        description=f"The config ({KINDS_TEXT}) first, then the files it names. It is mapped "
        "key by key; what has no counterpart, and what was assumed, is one line of the "
        "answer's warnings.",
    )
    set: dict[str, Any] = Field(
        default_factory=dict,
        max_length=64,
        description="Training spec keys set over the mapped config, dotted as --set's "
        '({"parallel.dp": 64, "micro_batch_size": 2}).',
    )


_STACK = TypeAdapter(StackConfigTrain)


def _is_stack(value: Any) -> bool:
    return isinstance(value, dict) and "stack_config" in value


def stack_shape(value: Any) -> Any:
    """A body's ``train`` as given; one that sends a stack's config (``stack_config``) is
    checked for the shape :class:`StackConfigTrain` documents (a 422 naming its field). What
    the files say is read by :func:`mapped_train`, in the route, as the planner reads a spec."""
    if _is_stack(value):
        try:
            _STACK.validate_python(value)
        except ValidationError as exc:
            raise ValueError(validation_message(exc, model=StackConfigTrain)) from None
    return value


def mapped_train(
    value: dict[str, Any] | None, model: planner.ModelSpec
) -> tuple[dict[str, Any] | None, list[str]]:
    """A body's ``train`` as a training spec's raw dict, and the warnings its mapping gives: a
    training spec as it is (no warning), a stack's own config mapped key by key (sized by
    ``model`` where it leaves DeepSpeed's buckets to it), its ``set`` keys over it, and the line
    naming what it did not map or assumed. A file that is none of the stacks' is a
    ``SpecError`` naming it (``train.stack_config``)."""
    if not _is_stack(value):
        return value, []
    given = _STACK.validate_python(value)
    try:
        stack = from_texts([(f.name, f.text) for f in given.stack_config])
    except planner.HeadroomError as exc:
        raise planner.SpecError(f"train.stack_config: {exc}", field="train.stack_config") from None
    stack = stack.with_model(model.hidden_size)
    data = copy.deepcopy(stack.train)  # set over a copy: the mapping stays as mapped
    for key, item in given.set.items():
        set_key(data, key, item)
    line = stack.warning(given.stack_config[0].name)
    return data, [f"train: {line}"] if line else []


TrainInput = Annotated[
    dict[str, Any] | None,
    documented_as(planner.TrainSpec | StackConfigTrain | None),
]
HostMemoryInput = Annotated[str | int | None, documented_as(SizeText | HostBytes | None)]
