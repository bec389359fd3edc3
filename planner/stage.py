"""What one rank of one pipeline stage holds: local parameter counts after TP/EP/PP sharding.

Everything here depends only on the model and the parallel layout, so it is computed once and
cached; the per-estimate arithmetic in ``planner.estimator`` then costs a few microseconds.
ZeRO sharding over data parallelism is applied later, per tensor class (dense or expert).
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import Generic, NamedTuple, TypeVar

from headroom.planner._memo import identity_memo
from headroom.planner.errors import SpecError
from headroom.planner.model import ModelSpec
from headroom.planner.params import TP_SHARDED_KINDS, Tensor, Unit, units

T = TypeVar("T")


class PerKind(NamedTuple, Generic[T]):
    """One value for each kind of decoder layer. A point's ``is_moe`` (0 or 1) indexes it."""

    dense: T
    moe: T


class StageParams(NamedTuple):
    """Local (per-rank) parameter facts of one pipeline stage."""

    stage: int
    num_layers: int
    num_moe_layers: int
    has_embedding: bool
    has_head: bool
    tied_embeddings: bool  # the embedding table is also this stage's head
    dense_numel: int
    expert_numel: int
    embedding_numel: int
    dense_layer_numel: int  # one dense layer of the stage (0 if none)
    moe_layer_numel: int  # one MoE layer's non-expert tensors (attention, router, shared)
    moe_layer_expert_numel: int  # one MoE layer's routed experts
    dense_layer_mlp_numel: int  # one dense layer's MLP
    moe_layer_shared_numel: int  # one MoE layer's shared experts
    head_unit_numel: int
    max_unit_numel: int
    largest_tensor_numel: int
    largest_matrix_numel: int
    matrix_dense_numel: int
    matrix_expert_numel: int
    adafactor_dense_numel: int
    adafactor_expert_numel: int
    adam8bit_dense_bytes: int
    adam8bit_expert_bytes: int
    order_numel: tuple[int, ...]
    order_is_expert: tuple[bool, ...]
    moe_flags: tuple[bool, ...]


def _local(t: Tensor, tp: int, ep: int) -> tuple[int, int]:
    """Local (rows, cols x count) of a tensor: TP splits the larger dim, EP splits experts."""
    rows, cols, count = t.rows, t.cols, t.copies
    if t.kind == "expert":
        count = -(-count // ep)
    if t.kind in TP_SHARDED_KINDS and tp > 1:
        if rows >= cols:
            rows = -(-rows // tp)
        else:
            cols = -(-cols // tp)
    return rows, cols * count


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Layers of each stage: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def _divisors(n: int, limit: int = 16) -> str:
    """The first ``limit`` divisors of ``n``, for a message."""
    found = [d for d in range(1, min(n, 2**16) + 1) if n % d == 0][:limit]
    return ", ".join(map(str, found)) + (", ..." if len(found) == limit else "")


def check_layout(model: ModelSpec, tp: int, pp: int, ep: int) -> None:
    """Refuse degrees the model cannot be split by: TP splits the attention heads, the KV heads
    and every FFN width it shards; PP needs a layer per stage; EP needs whole experts per rank.
    (The shards below round up, so such a layout would otherwise be estimated as if it ran.)"""
    if pp > model.num_layers:
        raise SpecError(
            f"train.parallel.pp: must be between 1 and num_layers ({model.num_layers}), got {pp}",
            field="train.parallel.pp",
        )
    if tp > 1:
        widths = {"num_heads": model.num_heads, "num_kv_heads": model.kv_heads}
        if model.num_moe_layers < model.num_layers:
            widths["ffn_hidden_size"] = model.ffn_hidden_size
        if model.moe is not None:
            widths["moe.expert_ffn_size"] = model.moe.expert_ffn_size
            if model.moe.num_shared_experts:
                widths["moe.shared_expert_ffn_size"] = model.moe.shared_ffn
        uneven = [f"{name} ({n})" for name, n in widths.items() if n % tp]
        if uneven:
            raise SpecError(
                f"train.parallel.tp: must divide {', '.join(uneven)}; allowed: "
                f"{_divisors(math.gcd(*widths.values()))}; got {tp}",
                field="train.parallel.tp",
            )
    if ep > 1 and model.moe is None:
        raise SpecError(
            f"train.parallel.ep: the model has no experts to split; allowed: 1, got {ep}",
            field="train.parallel.ep",
        )
    if model.moe is not None and model.moe.num_experts % ep:
        raise SpecError(
            f"train.parallel.ep: must divide moe.num_experts ({model.moe.num_experts}); "
            f"allowed: {_divisors(model.moe.num_experts)}; got {ep}",
            field="train.parallel.ep",
        )


@identity_memo(1024)
def stage_params(model: ModelSpec, tp: int, pp: int, ep: int, stage: int) -> StageParams:
    """Local parameter facts of ``stage`` under the given TP/PP/EP degrees (which
    ``check_layout`` must accept: it runs here, once per memoised entry)."""
    check_layout(model, tp, pp, ep)
    all_units = units(model)
    layer_range = stage_layer_ranges(model.num_layers, pp)[stage]
    has_embedding = stage == 0
    has_head = stage == pp - 1
    chosen: list[Unit] = []
    if has_embedding:
        chosen.append(all_units[0])
    chosen += [all_units[1 + i] for i in layer_range]
    if has_head:
        chosen.append(all_units[-1])
    dense = expert = embed = head_unit = 0
    largest = largest_matrix = 0
    matrix = [0, 0]
    adafactor = [0, 0]
    adam8 = [0, 0]
    order_numel: list[int] = []
    order_is_expert: list[bool] = []
    unit_sizes = []
    layer_numel = [0, 0, 0]  # a dense layer; an MoE layer's dense part and its experts
    mlp_numel = [0, 0]  # a dense layer's MLP; an MoE layer's shared experts
    for unit in chosen:
        unit_numel = 0
        unit_expert = 0
        unit_mlp = 0
        for t in unit.tensors:
            rows, cols = _local(t, tp, ep)
            numel = rows * cols
            is_expert = t.kind == "expert"
            k = 1 if is_expert else 0
            unit_numel += numel
            if t.kind in ("mlp", "shared_expert"):
                unit_mlp += numel
            if is_expert:
                expert += numel
                unit_expert += numel
            else:
                dense += numel
            per_tensor = rows * (cols // max(t.copies, 1)) if t.copies > 1 else numel
            largest = max(largest, per_tensor)
            if t.is_matrix:
                matrix[k] += numel
                largest_matrix = max(largest_matrix, per_tensor)
                copies = numel // per_tensor if per_tensor else 0
                adafactor[k] += copies * (rows + per_tensor // rows)
            else:
                adafactor[k] += numel
            copies = numel // per_tensor if per_tensor else 0
            if per_tensor >= 4096:  # bitsandbytes keeps smaller tensors' states in fp32
                adam8[k] += copies * (2 * per_tensor + 8 * -(-per_tensor // 2048))
            else:
                adam8[k] += 8 * numel
            order_numel.append(numel)
            order_is_expert.append(is_expert)
        unit_sizes.append(unit_numel)
        if unit.name == "embed_tokens":
            embed = unit_numel
        elif unit.name == "lm_head":
            head_unit = unit_numel
        elif unit.is_moe:
            layer_numel[1:] = [unit_numel - unit_expert, unit_expert]
            mlp_numel[1] = unit_mlp
        else:
            layer_numel[0] = unit_numel
            mlp_numel[0] = unit_mlp
    # A tied head streams the embedding matrix again: the largest unit is at least that big.
    if model.tied_embeddings and has_head:
        tied = _local(all_units[0].tensors[0], tp, ep)
        unit_sizes.append(head_unit + tied[0] * tied[1])
    layer_ids = list(layer_range)
    moe_flags = [model.is_moe_layer(i) for i in layer_ids]
    return StageParams(
        stage=stage,
        num_layers=len(layer_ids),
        num_moe_layers=sum(moe_flags),
        has_embedding=has_embedding,
        has_head=has_head,
        tied_embeddings=model.tied_embeddings and has_embedding and has_head,
        dense_numel=dense,
        expert_numel=expert,
        embedding_numel=embed,
        dense_layer_numel=layer_numel[0],
        moe_layer_numel=layer_numel[1],
        moe_layer_expert_numel=layer_numel[2],
        dense_layer_mlp_numel=mlp_numel[0],
        moe_layer_shared_numel=mlp_numel[1],
        head_unit_numel=head_unit,
        max_unit_numel=max(unit_sizes) if unit_sizes else 0,
        largest_tensor_numel=largest,
        largest_matrix_numel=largest_matrix,
        matrix_dense_numel=matrix[0],
        matrix_expert_numel=matrix[1],
        adafactor_dense_numel=adafactor[0],
        adafactor_expert_numel=adafactor[1],
        adam8bit_dense_bytes=adam8[0],
        adam8bit_expert_bytes=adam8[1],
        order_numel=tuple(order_numel),
        order_is_expert=tuple(order_is_expert),
        moe_flags=tuple(moe_flags),
    )


@identity_memo(4096)
def offloaded_numel(
    sp: StageParams, zero_dense: int, zero_expert: int, fraction: float
) -> tuple[int, int]:
    """(dense, expert) numel whose optimizer state is offloaded at ``fraction``.

    Megatron's HybridDeviceOptimizer semantics: walk the tensors in order and offload whole
    tensors while the offloaded count is below ``fraction`` x total.
    """
    if fraction <= 0.0:
        return 0, 0
    if fraction >= 1.0:  # everything, rounded as the shard itself is
        return -(-sp.dense_numel // zero_dense), -(-sp.expert_numel // zero_expert)
    sizes = [
        n // (zero_expert if e else zero_dense)
        for n, e in zip(sp.order_numel, sp.order_is_expert, strict=True)
    ]
    total = sum(sizes)
    threshold = total * fraction
    cumulative = list(accumulate(sizes))
    # offload tensor i while the sum before it is < threshold
    cut = bisect.bisect_left(cumulative, threshold) + 1
    if cut >= len(sizes):  # every tensor: the whole shard, rounded as the shard itself is
        return -(-sp.dense_numel // zero_dense), -(-sp.expert_numel // zero_expert)
    dense = sum(s for s, e in zip(sizes[:cut], sp.order_is_expert[:cut], strict=True) if not e)
    expert = sum(s for s, e in zip(sizes[:cut], sp.order_is_expert[:cut], strict=True) if e)
    return dense, expert
