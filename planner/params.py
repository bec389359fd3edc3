"""Parameter inventory: every weight tensor of a ModelSpec, in module order.

Counts are exact for the architectures Headroom knows (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE,
DeepSeek-V3): a test checks the published totals. Each tensor carries a ``kind`` that says how
tensor/expert parallelism shards it, and its 2-D shape, which factored optimizers need.
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner._memo import identity_memo
from headroom.planner.model import ModelSpec

#: kinds whose tensors are split across tensor-parallel ranks; others stay whole on every rank
TP_SHARDED_KINDS = frozenset({"embedding", "head", "attention", "mlp", "shared_expert", "expert"})


class Tensor(NamedTuple):
    """``copies`` identical tensors of shape ``rows x cols`` (``cols == 1`` for vectors)."""

    name: str
    rows: int
    cols: int
    copies: int
    kind: str

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.copies

    @property
    def is_matrix(self) -> bool:
        return self.cols > 1 and self.kind not in ("embedding", "head")


class Unit(NamedTuple):
    """A block the streaming trainer moves as one: the embedding, one layer, or the head."""

    name: str
    tensors: tuple[Tensor, ...]
    is_moe: bool

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


class ParamCount(NamedTuple):
    """Parameter totals of a model (the MTP modules are reported, not included)."""

    total: int
    embedding: int
    head: int
    per_token_active: int
    mtp_excluded: int


def _norm(name: str, model: ModelSpec, width: int) -> list[Tensor]:
    tensors = [Tensor(f"{name}.weight", width, 1, 1, "norm")]
    if model.norm == "layernorm":
        tensors.append(Tensor(f"{name}.bias", width, 1, 1, "norm"))
    return tensors


def _linear(
    name: str,
    model: ModelSpec,
    out: int,
    inp: int,
    kind: str,
    *,
    bias: bool = False,
    count: int = 1,
) -> list[Tensor]:
    tensors = [Tensor(f"{name}.weight", out, inp, count, kind)]
    if bias or model.linear_bias:
        tensors.append(Tensor(f"{name}.bias", out, 1, count, kind))
    return tensors


def _attention(model: ModelSpec, prefix: str) -> list[Tensor]:
    h, heads = model.hidden_size, model.num_heads
    mla = model.mla
    tensors: list[Tensor] = []
    if mla is None:
        d, kv = model.dim_per_head, model.kv_heads
        qkv_bias = model.qkv_bias
        tensors = [
            *_linear(f"{prefix}.q_proj", model, heads * d, h, "attention", bias=qkv_bias),
            *_linear(f"{prefix}.k_proj", model, kv * d, h, "attention", bias=qkv_bias),
            *_linear(f"{prefix}.v_proj", model, kv * d, h, "attention", bias=qkv_bias),
            *_linear(
                f"{prefix}.o_proj", model, h, heads * d, "attention", bias=model.attention_out_bias
            ),
        ]
        if model.qk_norm:
            tensors += _norm(f"{prefix}.q_norm", model, d) + _norm(f"{prefix}.k_norm", model, d)
        return tensors
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        tensors += _linear(f"{prefix}.q_proj", model, heads * qk_head, h, "attention")
    else:
        r = mla.q_lora_rank
        tensors += _linear(f"{prefix}.q_a_proj", model, r, h, "attention_replicated")
        tensors += _norm(f"{prefix}.q_a_layernorm", model, r)
        tensors += _linear(f"{prefix}.q_b_proj", model, heads * qk_head, r, "attention")
    kv_out = mla.kv_lora_rank + mla.qk_rope_head_dim
    tensors += _linear(f"{prefix}.kv_a_proj_with_mqa", model, kv_out, h, "attention_replicated")
    tensors += _norm(f"{prefix}.kv_a_layernorm", model, mla.kv_lora_rank)
    kv_b_out = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    tensors += _linear(f"{prefix}.kv_b_proj", model, kv_b_out, mla.kv_lora_rank, "attention")
    tensors += _linear(f"{prefix}.o_proj", model, h, heads * mla.v_head_dim, "attention")
    return tensors


def _ffn(model: ModelSpec, prefix: str, ffn: int, kind: str, count: int = 1) -> list[Tensor]:
    h = model.hidden_size
    bias = model.mlp_bias and kind == "mlp"  # Llama's mlp_bias: the dense MLP, not experts
    if model.ffn_kind == "swiglu":
        return [
            *_linear(f"{prefix}.gate_proj", model, ffn, h, kind, bias=bias, count=count),
            *_linear(f"{prefix}.up_proj", model, ffn, h, kind, bias=bias, count=count),
            *_linear(f"{prefix}.down_proj", model, h, ffn, kind, bias=bias, count=count),
        ]
    return [
        *_linear(f"{prefix}.fc1", model, ffn, h, kind, bias=bias, count=count),
        *_linear(f"{prefix}.fc2", model, h, ffn, kind, bias=bias, count=count),
    ]


def _moe_ffn(model: ModelSpec, prefix: str) -> list[Tensor]:
    moe = model.moe
    assert moe is not None
    h = model.hidden_size
    tensors = [Tensor(f"{prefix}.gate.weight", moe.num_experts, h, 1, "router")]
    if moe.router_bias:
        tensors.append(
            Tensor(f"{prefix}.gate.e_score_correction_bias", moe.num_experts, 1, 1, "router")
        )
    tensors += _ffn(model, f"{prefix}.experts", moe.expert_ffn_size, "expert", moe.num_experts)
    if moe.num_shared_experts:
        # the shared experts are one MLP of their summed width, as DeepSeek builds and stores
        # them (n_shared_experts x moe_intermediate_size): the same sum, one matmul per projection
        width = moe.num_shared_experts * moe.shared_ffn
        tensors += _ffn(model, f"{prefix}.shared_experts", width, "shared_expert")
    if moe.shared_expert_gate:
        tensors.append(Tensor(f"{prefix}.shared_expert_gate.weight", 1, h, 1, "router"))
    return tensors


def _layer(model: ModelSpec, index: int, prefix: str) -> Unit:
    h = model.hidden_size
    is_moe = model.is_moe_layer(index)
    tensors = [
        *_norm(f"{prefix}.input_layernorm", model, h),
        *_attention(model, f"{prefix}.self_attn"),
        *_norm(f"{prefix}.post_attention_layernorm", model, h),
    ]
    if is_moe:
        tensors += _moe_ffn(model, f"{prefix}.mlp")
    else:
        tensors += _ffn(model, f"{prefix}.mlp", model.ffn_hidden_size, "mlp")
    return Unit(prefix, tuple(tensors), is_moe)


@identity_memo(256)
def units(model: ModelSpec) -> tuple[Unit, ...]:
    """The model's streamable units in module order: embedding, layers, then norm + head.

    With tied embeddings the head unit holds only the final norm: the shared matrix is counted
    once, in the embedding unit.
    """
    h, v = model.hidden_size, model.vocab_size
    embed = Unit("embed_tokens", (Tensor("embed_tokens.weight", v, h, 1, "embedding"),), False)
    layers = tuple(_layer(model, i, f"layers.{i}") for i in range(model.num_layers))
    head_tensors = list(_norm("norm", model, h))
    if not model.tied_embeddings:
        head_tensors.append(Tensor("lm_head.weight", v, h, 1, "head"))
    return (embed, *layers, Unit("lm_head", tuple(head_tensors), False))


def mtp_tensors(model: ModelSpec) -> tuple[Tensor, ...]:
    """Tensors of the multi-token-prediction modules (DeepSeek-V3), sharing embedding and head."""
    h = model.hidden_size
    tensors: list[Tensor] = []
    for k in range(model.num_mtp_layers):
        index = model.num_layers + k
        prefix = f"mtp.{k}"
        tensors += _norm(f"{prefix}.enorm", model, h)
        tensors += _norm(f"{prefix}.hnorm", model, h)
        tensors.append(Tensor(f"{prefix}.eh_proj.weight", h, 2 * h, 1, "mlp"))
        tensors += _layer(model, index, prefix).tensors
        tensors += _norm(f"{prefix}.shared_head.norm", model, h)
    return tuple(tensors)


@identity_memo(256)
def count_params(model: ModelSpec) -> ParamCount:
    """Exact parameter totals; ``per_token_active`` counts only ``top_k`` routed experts."""
    all_units = units(model)
    total = sum(u.numel for u in all_units)
    embedding = all_units[0].numel
    head = sum(t.numel for t in all_units[-1].tensors if t.kind == "head")
    inactive = 0
    if model.moe is not None:
        moe = model.moe
        for unit in all_units:
            for t in unit.tensors:
                if t.kind == "expert":
                    inactive += t.numel // moe.num_experts * (moe.num_experts - moe.top_k)
    mtp = sum(t.numel for t in mtp_tensors(model))
    return ParamCount(total, embedding, head, total - inactive, mtp)
