"""The model spec: dense and MoE decoder-only transformers, with GQA or MLA attention.

One frozen pydantic model describes the architecture; its parameter inventory lives in
``planner.params``. Field names follow the planner's vocabulary, not any one framework's;
``planner.hf`` maps Hugging Face ``config.json`` files onto it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MoESpec(_Frozen):
    """Mixture-of-Experts feed-forward layers."""

    num_experts: int = Field(ge=1, description="Routed experts per MoE layer.")
    top_k: int = Field(ge=1, description="Routed experts each token is sent to.")
    expert_ffn_size: int = Field(ge=1, description="Intermediate size of one routed expert.")
    num_shared_experts: int = Field(default=0, ge=0, description="Always-active shared experts.")
    shared_expert_ffn_size: int | None = Field(
        default=None, ge=1, description="Intermediate size of one shared expert (default: expert)."
    )
    shared_expert_gate: bool = Field(
        default=False, description="A sigmoid gate (hidden -> 1) on the shared expert (Qwen2-MoE)."
    )
    dense_first_layers: int = Field(
        default=0, ge=0, description="Leading layers that use the dense FFN instead of experts."
    )
    layer_freq: int = Field(
        default=1, ge=1, description="After the dense-first layers, every k-th layer is MoE."
    )
    dense_layers: tuple[int, ...] = Field(
        default=(), description="Layer indices forced dense (Qwen2-MoE mlp_only_layers)."
    )
    router_bias: bool = Field(
        default=False, description="A per-expert routing bias (DeepSeek-V3 aux-loss-free)."
    )
    capacity_factor: float | None = Field(
        default=None, gt=0, description="Architecture's capacity factor; training spec overrides."
    )

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

    q_lora_rank: int | None = Field(default=None, ge=1, description="Q down-projection rank.")
    kv_lora_rank: int = Field(ge=1, description="Joint KV compression rank.")
    qk_nope_head_dim: int = Field(ge=1, description="Per-head Q/K dims without RoPE.")
    qk_rope_head_dim: int = Field(ge=0, description="Per-head Q/K dims carrying RoPE.")
    v_head_dim: int = Field(ge=1, description="Per-head V dims.")


class ModelSpec(_Frozen):
    """A decoder-only transformer, dense or MoE."""

    name: str = Field(default="custom", description="Display name.")
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int | None = Field(default=None, ge=1, description="GQA groups (default MHA).")
    head_dim: int | None = Field(default=None, ge=1, description="Default hidden / heads.")
    ffn_hidden_size: int = Field(ge=1, description="Dense FFN intermediate size.")
    ffn_kind: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    tied_embeddings: bool = False
    qkv_bias: bool = Field(default=False, description="Biases on Q, K, V projections (Qwen2).")
    linear_bias: bool = Field(default=False, description="Biases on every linear (GPT-2 style).")
    dropout: bool = Field(default=False, description="Dropout layers saving masks (GPT style).")
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    num_mtp_layers: int = Field(
        default=0, ge=0, description="Multi-token-prediction modules (not trained by Headroom)."
    )
    source: str | None = Field(default=None, description="Where this spec came from.")

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
        if self.moe is not None and self.moe.dense_first_layers > self.num_layers:
            raise ValueError(
                f"moe.dense_first_layers must be between 0 and num_layers ({self.num_layers}), "
                f"got {self.moe.dense_first_layers}"
            )
        return self

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
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))
