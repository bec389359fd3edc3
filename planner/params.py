"""Parameter inventory: every weight tensor of a ModelSpec, in module order.

Counts are exact for the architectures Headroom reads (``planner.hf``): tests check them against
the published totals and against transformers' own modules. Each tensor carries a ``kind``
that says how tensor/expert parallelism shards it, and its 2-D shape, which factored optimizers
need.
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner._memo import SMALL_ENTRY_BYTES, identity_memo
from headroom.planner.model import ModelSpec, spec_bytes

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


def _norm(name: str, model: ModelSpec, width: int, copies: int = 1) -> list[Tensor]:
    weight, bias = model.norm_weights
    tensors = [Tensor(f"{name}.weight", width, 1, copies, "norm")] if weight else []
    if bias:
        tensors.append(Tensor(f"{name}.bias", width, 1, copies, "norm"))
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
        if model.qk_norm:  # one head_dim weight the heads share, or one per head
            per_head = model.qk_norm_weights == "per_head"
            tensors += _norm(f"{prefix}.q_norm", model, d, heads if per_head else 1)
            tensors += _norm(f"{prefix}.k_norm", model, d, kv if per_head else 1)
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
    if model.gated_ffn:
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


def _layer(model: ModelSpec, is_moe: bool, prefix: str) -> Unit:
    h = model.hidden_size
    before, between, after = (
        [t for name in group for t in _norm(f"{prefix}.{name}", model, h)]
        for group in model.layer_norms
    )
    if is_moe:
        mlp = _moe_ffn(model, f"{prefix}.mlp")
    else:
        mlp = _ffn(model, f"{prefix}.mlp", model.ffn_hidden_size, "mlp")
    tensors = [*before, *_attention(model, f"{prefix}.self_attn"), *between, *mlp, *after]
    return Unit(prefix, tuple(tensors), is_moe)


class UnitKinds(NamedTuple):
    """One unit of each kind: every dense layer of a model is the same unit (up to its name),
    and so is every MoE layer; the estimator reads these with each kind's count, never a unit
    per layer, so its work and memory do not grow with the number of layers."""

    embed: Unit
    dense: Unit  # a dense layer (named ``layers.N``)
    moe: Unit | None  # an MoE layer (None: the model has no experts)
    head: Unit  # the final norm, and the head matrix unless tied to the embedding


#: a model's units by kind: a few dozen named tensors
_UNITS_BYTES = 24576


@identity_memo(256, 2 << 20, nbytes=lambda model: spec_bytes(model) + _UNITS_BYTES)
def unit_kinds(model: ModelSpec) -> UnitKinds:
    """The model's units by kind (see ``UnitKinds``)."""
    h, v = model.hidden_size, model.vocab_size
    embed = Unit("embed_tokens", (Tensor("embed_tokens.weight", v, h, 1, "embedding"),), False)
    head_tensors = list(_norm("norm", model, h))
    if not model.tied_embeddings:
        head_tensors.append(Tensor("lm_head.weight", v, h, 1, "head"))
    moe = _layer(model, True, "layers.N") if model.moe is not None else None
    return UnitKinds(
        embed, _layer(model, False, "layers.N"), moe, Unit("lm_head", tuple(head_tensors), False)
    )


def units(model: ModelSpec) -> tuple[Unit, ...]:
    """The model's streamable units in module order: embedding, layers, then norm + head.

    With tied embeddings the head unit holds only the final norm: the shared matrix is counted
    once, in the embedding unit. One unit per layer, named as the checkpoint names it: an
    inventory to read, which the estimator does not build (``unit_kinds``).
    """
    kinds = unit_kinds(model)
    layers = tuple(
        _layer(model, model.is_moe_layer(i), f"layers.{i}") for i in range(model.num_layers)
    )
    return (kinds.embed, *layers, kinds.head)


def _mtp_module_numel(model: ModelSpec, layer: Unit) -> int:
    """Parameters of one multi-token-prediction module (DeepSeek-V3) around ``layer``: its
    norms and projection; the embedding and head are shared."""
    h = model.hidden_size
    norms = 3 * sum(t.numel for t in _norm("norm", model, h))  # enorm, hnorm, shared_head.norm
    return norms + 2 * h * h + layer.numel  # eh_proj: 2h -> h


@identity_memo(256, 2 << 20, nbytes=lambda model: spec_bytes(model) + SMALL_ENTRY_BYTES)
def count_params(model: ModelSpec) -> ParamCount:
    """Exact parameter totals; ``per_token_active`` counts only ``top_k`` routed experts."""
    kinds = unit_kinds(model)
    num_moe = model.moe_layers_between(0, model.num_layers)
    num_dense = model.num_layers - num_moe
    total = kinds.embed.numel + num_dense * kinds.dense.numel + kinds.head.numel
    embedding = kinds.embed.numel
    head = sum(t.numel for t in kinds.head.tensors if t.kind == "head")
    inactive = 0
    mtp_moe = model.moe_layers_between(model.num_layers, model.num_layers + model.num_mtp_layers)
    mtp = (model.num_mtp_layers - mtp_moe) * _mtp_module_numel(model, kinds.dense)
    if model.moe is not None and kinds.moe is not None:
        moe = model.moe
        total += num_moe * kinds.moe.numel
        per_layer = sum(
            t.numel // moe.num_experts * (moe.num_experts - moe.top_k)
            for t in kinds.moe.tensors
            if t.kind == "expert"
        )
        inactive = num_moe * per_layer
        mtp += mtp_moe * _mtp_module_numel(model, kinds.moe)
    return ParamCount(total, embedding, head, total - inactive, mtp)
