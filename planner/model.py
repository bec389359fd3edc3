"""The model spec: dense and MoE decoder-only transformers, with GQA or MLA attention.

One frozen pydantic model describes the architecture; its parameter inventory lives in
``planner.params``. Field names follow the planner's vocabulary, not any one framework's;
``planner.hf`` maps Hugging Face ``config.json`` files onto it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, field_validator, model_validator

from headroom.planner._keys import FewUnknownKeys
from headroom.planner._numbers import INTEGER, NUMBER, Int

#: upper bounds that keep every estimate finite and fast: sizes (vocab, hidden, FFN, head and
#: rank dims), counts (heads, experts), layers (the estimator walks every layer) and factors
_MAX_SIZE = 2**24
_MAX_COUNT = 2**20
_MAX_LAYERS = 4096
#: layers a spec may force dense one by one: each breaks the layers' pattern, and the
#: estimator's backward (and the search over it) weighs the layers around every break
_MAX_DENSE_LAYERS = 256
_MAX_FACTOR = 10_000.0
#: text ends up in database columns and JSON responses: no NUL, and valid Unicode (the pattern
#: check refuses lone surrogates, which no UTF-8 encoder writes)
_TEXT = r"^[^\x00]*$"


#: each norm placement's norms, as checkpoints name them: Llama's two before attention and the
#: MLP, Gemma's four around them, OLMo 2's two after them, Cohere's one before both
_LAYER_NORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "pre": (("input_layernorm",), ("post_attention_layernorm",), ()),
    "sandwich": (
        ("input_layernorm",),
        ("post_attention_layernorm", "pre_feedforward_layernorm"),
        ("post_feedforward_layernorm",),
    ),
    "post": ((), ("post_attention_layernorm",), ("post_feedforward_layernorm",)),
    "parallel": (("input_layernorm",), (), ()),
}


class _Frozen(FewUnknownKeys):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class MoESpec(_Frozen):
    """Mixture-of-Experts feed-forward layers."""

    num_experts: Int = Field(ge=1, le=_MAX_COUNT, description="Routed experts per MoE layer.")
    top_k: Int = Field(ge=1, le=_MAX_COUNT, description="Routed experts each token is sent to.")
    expert_ffn_size: Int = Field(
        ge=1, le=_MAX_SIZE, description="Intermediate size of one routed expert."
    )
    num_shared_experts: Int = Field(
        default=0, ge=0, le=_MAX_COUNT, description="Always-active shared experts."
    )
    shared_expert_ffn_size: Annotated[int, Field(ge=1, le=_MAX_SIZE), INTEGER] | None = Field(
        default=None,
        description="Intermediate size of one shared expert (default: expert).",
    )
    shared_expert_gate: StrictBool = Field(
        default=False, description="A sigmoid gate (hidden -> 1) on the shared expert (Qwen2-MoE)."
    )
    dense_first_layers: Int = Field(
        default=0,
        ge=0,
        le=_MAX_LAYERS,
        description="Leading layers that use the dense FFN instead of experts.",
    )
    layer_freq: Int = Field(
        default=1,
        ge=1,
        le=_MAX_LAYERS,
        description="After the dense-first layers, every k-th layer is MoE.",
    )
    dense_layers: tuple[Annotated[int, Field(ge=0, lt=_MAX_LAYERS), INTEGER], ...] = Field(
        default=(),
        max_length=_MAX_DENSE_LAYERS,
        description="Layer indices forced dense (Qwen2-MoE mlp_only_layers).",
    )
    router_bias: StrictBool = Field(
        default=False, description="A per-expert routing bias (DeepSeek-V3 aux-loss-free)."
    )
    routing_weights_fp32: StrictBool = Field(
        default=False,
        description="The experts' outputs are scaled by fp32 routing weights before they are "
        "cast back (DeepSeek-V2/V3): the products and their gradients are fp32, slot-wide.",
    )
    capacity_factor: Annotated[float, Field(gt=0, le=_MAX_FACTOR), NUMBER] | None = Field(
        default=None,
        description="Architecture's capacity factor; training spec overrides.",
    )

    @field_validator("dense_layers", mode="before")
    @classmethod
    def _few_enough(cls, value: Any) -> Any:
        # refused before its items are: 100k bad items make 100k errors, seconds to report
        if isinstance(value, list | tuple) and len(value) > _MAX_DENSE_LAYERS:
            raise ValueError(
                f"at most {_MAX_DENSE_LAYERS} layer indices (layer_freq and dense_first_layers "
                f"describe a regular pattern), got {len(value)}"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"moe.top_k must be between 1 and moe.num_experts ({self.num_experts}), "
                f"got {self.top_k}"
            )
        return self

    @property
    def shared_ffn(self) -> int:
        return self.shared_expert_ffn_size or self.expert_ffn_size


class MLASpec(_Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank Q and joint KV projections."""

    q_lora_rank: Annotated[int, Field(ge=1, le=_MAX_SIZE), INTEGER] | None = Field(
        default=None, description="Q down-projection rank."
    )
    kv_lora_rank: Int = Field(ge=1, le=_MAX_SIZE, description="Joint KV compression rank.")
    qk_nope_head_dim: Int = Field(ge=1, le=_MAX_SIZE, description="Per-head Q/K dims without RoPE.")
    qk_rope_head_dim: Int = Field(
        ge=0, le=_MAX_SIZE, description="Per-head Q/K dims carrying RoPE."
    )
    v_head_dim: Int = Field(ge=1, le=_MAX_SIZE, description="Per-head V dims.")


class ModelSpec(_Frozen):
    """A decoder-only transformer, dense or MoE."""

    name: str = Field(default="custom", max_length=200, pattern=_TEXT, description="Display name.")
    vocab_size: Int = Field(ge=1, le=_MAX_SIZE)
    hidden_size: Int = Field(ge=1, le=_MAX_SIZE)
    num_layers: Int = Field(ge=1, le=_MAX_LAYERS)
    num_heads: Int = Field(ge=1, le=_MAX_COUNT)
    num_kv_heads: Annotated[int, Field(ge=1, le=_MAX_COUNT), INTEGER] | None = Field(
        default=None, description="GQA groups (default MHA)."
    )
    head_dim: Annotated[int, Field(ge=1, le=_MAX_SIZE), INTEGER] | None = Field(
        default=None, description="Default hidden / heads."
    )
    ffn_hidden_size: Int = Field(ge=1, le=_MAX_SIZE, description="Dense FFN intermediate size.")
    ffn_kind: Literal["swiglu", "geglu", "gelu"] = Field(
        default="swiglu",
        description="swiglu: gated SiLU MLP, three matrices (Llama); geglu: gated GELU, three "
        "matrices (Gemma); gelu: two matrices (GPT).",
    )
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_params: Literal["weight", "weight_and_bias", "none"] | None = Field(
        default=None,
        description="What each norm learns (default: rmsnorm a weight, layernorm a weight and a "
        "bias); Cohere's LayerNorm has no bias, OLMo's none at all.",
    )
    norm_placement: Literal["pre", "sandwich", "post", "parallel"] = Field(
        default="pre",
        description="pre: a norm before attention and before the MLP (Llama); sandwich: also "
        "one after each (Gemma 2 and 3); post: only after each (OLMo 2); parallel: one norm, "
        "attention and the MLP side by side on its output (Cohere).",
    )
    tied_embeddings: StrictBool = False
    qkv_bias: StrictBool = Field(
        default=False, description="Biases on Q, K, V projections (Qwen2)."
    )
    attention_out_bias: StrictBool = Field(
        default=False,
        description="A bias on the attention output projection (Llama's and Qwen3's "
        "attention_bias, which also biases Q, K and V).",
    )
    mlp_bias: StrictBool = Field(
        default=False, description="Biases on the dense MLP (Llama's mlp_bias)."
    )
    qk_norm: StrictBool = Field(
        default=False,
        description="A norm over each head's queries and keys before RoPE, one head_dim weight "
        "each for Q and K (Qwen3).",
    )
    qk_norm_weights: Literal["shared", "per_head"] = Field(
        default="shared",
        description="With qk_norm: one head_dim weight the heads share (Qwen3, Gemma 3), or a "
        "weight per head (OLMo 2's norm over all heads, Cohere's per-head norm).",
    )
    sliding_window: Annotated[int, Field(ge=1, le=_MAX_SIZE * 16), INTEGER] | None = Field(
        default=None,
        description="Keys each query attends to in a sliding-window layer (Mistral, Gemma, "
        "StarCoder2). It changes attention's FLOPs under a kernel that skips masked blocks, "
        "not the memory a training step saves.",
    )
    global_attention_every: Annotated[int, Field(ge=1, le=_MAX_LAYERS), INTEGER] | None = Field(
        default=None,
        description="With sliding_window: every k-th layer attends to the whole sequence "
        "(Gemma 2: 2, Gemma 3: 6); none: every layer slides.",
    )
    attn_logit_softcap: Annotated[float, Field(gt=0, le=_MAX_FACTOR), NUMBER] | None = Field(
        default=None,
        description="tanh soft-capping of attention scores (Gemma 2): eager attention keeps "
        "the capped scores beside the probabilities.",
    )
    final_logit_softcap: Annotated[float, Field(gt=0, le=_MAX_FACTOR), NUMBER] | None = Field(
        default=None,
        description="tanh soft-capping of the logits (Gemma 2): one more logits-sized tensor.",
    )
    linear_bias: StrictBool = Field(
        default=False, description="Biases on every linear (GPT-2 style)."
    )
    dropout: StrictBool = Field(
        default=False, description="Dropout layers saving masks (GPT style)."
    )
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    num_mtp_layers: Int = Field(
        default=0,
        ge=0,
        le=_MAX_LAYERS,
        description="Multi-token-prediction modules (not trained by Headroom).",
    )
    source: str | None = Field(
        default=None, max_length=4000, pattern=_TEXT, description="Where this spec came from."
    )

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads must divide num_heads ({self.num_heads}), got {self.num_kv_heads}"
            )
        if self.head_dim is None and self.mla is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"head_dim is required when hidden_size ({self.hidden_size}) is not a multiple "
                f"of num_heads ({self.num_heads})"
            )
        if self.qk_norm and self.mla is not None:
            raise ValueError("qk_norm must be false with mla (MLA normalises its latents)")
        if self.global_attention_every is not None and self.sliding_window is None:
            raise ValueError("global_attention_every needs a sliding_window")
        if self.moe is not None and self.moe.dense_first_layers > self.num_layers:
            raise ValueError(
                f"moe.dense_first_layers must be between 0 and num_layers ({self.num_layers}), "
                f"got {self.moe.dense_first_layers}"
            )
        return self

    @property
    def gated_ffn(self) -> bool:
        """Whether the MLP is gated: three matrices, an activation times a linear branch."""
        return self.ffn_kind != "gelu"

    @property
    def norm_weights(self) -> tuple[bool, bool]:
        """(a weight, a bias) each norm learns."""
        params = self.norm_params or ("weight" if self.norm == "rmsnorm" else "weight_and_bias")
        return params != "none", params == "weight_and_bias"

    @property
    def layer_norms(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The hidden-width norms of each layer as checkpoints name them: (before attention,
        between attention and the MLP, after the MLP)."""
        return _LAYER_NORMS[self.norm_placement]

    @property
    def norms_per_layer(self) -> int:
        """Norms over the hidden width in each layer (query/key norms apart)."""
        return sum(map(len, self.layer_norms))

    def sliding_layers_between(self, start: int, stop: int) -> int:
        """How many of layers ``start`` … ``stop - 1`` attend within ``sliding_window``
        (counted: layer i is global when ``(i + 1) % global_attention_every == 0``)."""
        if self.sliding_window is None or stop <= start:
            return 0
        every = self.global_attention_every
        if every is None:
            return stop - start
        return (stop - start) - (stop // every - start // every)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) uses routed experts."""
        moe = self.moe
        if moe is None or index < moe.dense_first_layers or index in moe.dense_layers:
            return False
        return (index - moe.dense_first_layers) % moe.layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return self.moe_layers_between(0, self.num_layers)

    def moe_layers_between(self, start: int, stop: int) -> int:
        """How many of layers ``start`` … ``stop - 1`` use routed experts (counted, not walked:
        a 4,096-layer model costs what a 4-layer one does)."""
        moe = self.moe
        if moe is None:
            return 0
        first, every = moe.dense_first_layers, moe.layer_freq
        start = max(start, first)
        if stop <= start:
            return 0
        # layers first + m·every in [start, stop), less those forced dense
        pattern = (stop - 1 - first) // every - (start - 1 - first) // every
        forced = {i for i in moe.dense_layers if start <= i < stop and (i - first) % every == 0}
        return pattern - len(forced)

    def moe_flags(self, start: int, stop: int) -> bytes:
        """One byte for each of layers ``start`` … ``stop - 1``: 1 where it uses routed experts
        (bytes: a byte per layer, and hashed once)."""
        moe = self.moe
        if moe is None:
            return bytes(max(stop - start, 0))
        first, every, forced = moe.dense_first_layers, moe.layer_freq, set(moe.dense_layers)
        return bytes(
            i >= first and (i - first) % every == 0 and i not in forced for i in range(start, stop)
        )


def spec_bytes(model: ModelSpec) -> int:
    """An upper bound of the bytes a parsed spec holds: what a cache entry that keeps it alive
    weighs (``planner._memo``)."""
    text = len(model.name) + len(model.source or "")
    return 4096 + 4 * text + (64 * len(model.moe.dense_layers) if model.moe else 0)
