"""What one rank of one pipeline stage holds: local parameter counts after TP/EP/PP sharding.

Everything here depends only on the model and the parallel layout, so it is computed once and
cached; the per-estimate arithmetic in ``planner.estimator`` then costs a few microseconds.
ZeRO sharding over data parallelism is applied later, per tensor class (dense or expert).
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import Generic, NamedTuple, TypeVar

from headroom.planner._memo import SMALL_ENTRY_BYTES, identity_memo
from headroom.planner.errors import SpecError
from headroom.planner.model import ModelSpec, spec_bytes
from headroom.planner.params import TP_SHARDED_KINDS, Tensor, Unit, unit_kinds

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
    unit_tensors: tuple[tuple[tuple[int, bool], ...], ...]  # (local numel, is expert) of each
    # tensor of the embedding, a dense layer, an MoE layer and the head unit (``UNIT_*``), in
    # module order; a unit the stage does not hold has none
    moe_flags: bytes  # a byte per layer of the stage: 1 for an MoE layer, 0 for a dense one


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


#: ``StageParams.unit_tensors``' units
UNIT_EMBED, UNIT_DENSE, UNIT_MOE, UNIT_HEAD = range(4)


def stage_bytes(sp: StageParams) -> int:
    """An upper bound of the bytes ``sp`` holds: its numbers, each unit's tensors and a byte
    per layer (a cache entry's weight, ``planner._memo``)."""
    return 16384 + len(sp.moe_flags)


def _stage_entry_bytes(
    model: ModelSpec, tp: int, pp: int, ep: int, stage: int, v_shaped: bool = False
) -> int:
    return spec_bytes(model) + 16384 + -(-model.num_layers // pp)


def v_chunks(num_layers: int, pp: int, stage: int) -> tuple[range, range]:
    """The two model chunks rank ``stage`` holds under a V schedule: chunks ``stage`` and
    ``2 pp - 1 - stage`` of ``2 pp`` (torch.distributed.pipelining's
    ``generate_stage_to_rank_mapping(..., style="v")``), split as ``stage_layer_ranges``."""
    chunks = stage_layer_ranges(num_layers, 2 * pp)
    return chunks[stage], chunks[2 * pp - 1 - stage]


@identity_memo(1024, 8 << 20, nbytes=_stage_entry_bytes)
def stage_params(
    model: ModelSpec, tp: int, pp: int, ep: int, stage: int, v_shaped: bool = False
) -> StageParams:
    """Local parameter facts of ``stage`` under the given TP/PP/EP degrees (which
    ``check_layout`` must accept: it runs here, once per memoised entry). ``v_shaped``: the
    rank holds two chunks in a V (``v_chunks``; ``planner.schedules.V_SHAPED``), so the
    first rank holds the embedding and the head.

    Each kind of unit is read once and counted as often as the stage holds it, so a stage of
    4,096 layers costs what one of four does (but for its list of layer kinds)."""
    check_layout(model, tp, pp, ep)
    if v_shaped and 2 * pp > model.num_layers:
        raise SpecError(
            f"train.parallel.pp: a V schedule splits the model into 2 x pp chunks, so pp must "
            f"be between 1 and num_layers / 2 ({model.num_layers // 2}), got {pp}",
            field="train.parallel.pp",
        )
    kinds = unit_kinds(model)
    has_embedding = stage == 0
    if v_shaped:
        low, high = v_chunks(model.num_layers, pp, stage)
        has_head = stage == 0
        moe_flags = model.moe_flags(low.start, low.stop) + model.moe_flags(high.start, high.stop)
    else:
        layer_range = stage_layer_ranges(model.num_layers, pp)[stage]
        has_head = stage == pp - 1
        moe_flags = model.moe_flags(layer_range.start, layer_range.stop)
    num_moe = sum(moe_flags)
    head = kinds.head
    if model.tied_embeddings and has_head and not has_embedding:
        # A pipeline's last stage keeps a copy of the tied matrix as its head, with its own
        # gradient and optimizer state, kept equal to the first stage's by an all-reduce of
        # their gradients (Megatron-Core's ``setup_embeddings_and_output_layer``; DeepSpeed's
        # ``TiedLayerSpec``): counted once per stage that holds it, not once per model.
        table = kinds.embed.tensors[0]
        head = Unit(head.name, (*head.tensors, table._replace(kind="head")), False)
    held: list[tuple[Unit | None, int]] = [
        (kinds.embed, int(has_embedding)),
        (kinds.dense, len(moe_flags) - num_moe),
        (kinds.moe, num_moe),
        (head, int(has_head)),
    ]
    dense = expert = embed = head_unit = 0
    largest = largest_matrix = 0
    matrix = [0, 0]
    adafactor = [0, 0]
    adam8 = [0, 0]
    unit_tensors: list[tuple[tuple[int, bool], ...]] = []
    unit_sizes = []
    layer_numel = [0, 0, 0]  # a dense layer; an MoE layer's dense part and its experts
    mlp_numel = [0, 0]  # a dense layer's MLP; an MoE layer's shared experts
    for index, (unit, count) in enumerate(held):
        if unit is None or not count:
            unit_tensors.append(())
            continue
        unit_numel = 0
        unit_expert = 0
        unit_mlp = 0
        local: list[tuple[int, bool]] = []
        for t in unit.tensors:
            rows, cols = _local(t, tp, ep)
            numel = rows * cols
            is_expert = t.kind == "expert"
            k = 1 if is_expert else 0
            unit_numel += numel
            if t.kind in ("mlp", "shared_expert"):
                unit_mlp += numel
            if is_expert:
                expert += count * numel
                unit_expert += numel
            else:
                dense += count * numel
            per_tensor = rows * (cols // max(t.copies, 1)) if t.copies > 1 else numel
            largest = max(largest, per_tensor)
            copies = numel // per_tensor if per_tensor else 0
            if t.is_matrix:
                matrix[k] += count * numel
                largest_matrix = max(largest_matrix, per_tensor)
                adafactor[k] += count * copies * (rows + per_tensor // rows)
            else:
                adafactor[k] += count * numel
            if per_tensor >= 4096:  # bitsandbytes keeps smaller tensors' states in fp32
                adam8[k] += count * copies * (2 * per_tensor + 8 * -(-per_tensor // 2048))
            else:
                adam8[k] += count * 8 * numel
            local.append((numel, is_expert))
        unit_tensors.append(tuple(local))
        unit_sizes.append(unit_numel)
        if index == UNIT_EMBED:
            embed = unit_numel
        elif index == UNIT_HEAD:
            head_unit = unit_numel
        elif index == UNIT_MOE:
            layer_numel[1:] = [unit_numel - unit_expert, unit_expert]
            mlp_numel[1] = unit_mlp
        else:
            layer_numel[0] = unit_numel
            mlp_numel[0] = unit_mlp
    # A tied head streams the embedding matrix again: the largest unit is at least that big.
    if model.tied_embeddings and has_head and has_embedding:
        tied = _local(kinds.embed.tensors[0], tp, ep)
        unit_sizes.append(head_unit + tied[0] * tied[1])
    return StageParams(
        stage=stage,
        num_layers=len(moe_flags),
        num_moe_layers=num_moe,
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
        unit_tensors=tuple(unit_tensors),
        moe_flags=moe_flags,
    )


def unit_order(sp: StageParams) -> list[tuple[int, int]]:
    """The stage's units in module order as runs: (``UNIT_*``, how many in a row)."""
    runs = [(UNIT_EMBED, 1)] if sp.has_embedding else []
    runs += [
        (UNIT_MOE if is_moe else UNIT_DENSE, sum(1 for _ in run))
        for is_moe, run in groupby(sp.moe_flags)
    ]
    if sp.has_head:
        runs.append((UNIT_HEAD, 1))
    return runs


@identity_memo(4096, 2 << 20, nbytes=lambda sp, *_: SMALL_ENTRY_BYTES + stage_bytes(sp))
def offloaded_numel(
    sp: StageParams, zero_dense: int, zero_expert: int, fraction: float
) -> tuple[int, int]:
    """(dense, expert) numel whose optimizer state is offloaded at ``fraction``.

    Megatron's HybridDeviceOptimizer semantics: walk the tensors in order and offload whole
    tensors while the offloaded count is below ``fraction`` x total (the tensor that reaches
    it included). Runs of identical layers are stepped over whole, or into at the layer where
    the count reaches it.
    """
    whole = -(-sp.dense_numel // zero_dense), -(-sp.expert_numel // zero_expert)
    if fraction <= 0.0:
        return 0, 0
    if fraction >= 1.0:  # everything, rounded as the shard itself is
        return whole
    # each unit's tensors as (shard size, is expert), and its totals (all, dense, expert)
    shards = [[(n // (zero_expert if e else zero_dense), e) for n, e in u] for u in sp.unit_tensors]
    sums = [
        (sum(s for s, _ in u), sum(s for s, e in u if not e), sum(s for s, e in u if e))
        for u in shards
    ]
    order = unit_order(sp)
    threshold = sum(sums[u][0] * count for u, count in order) * fraction
    before = dense = expert = 0  # the count so far, and its dense and expert parts
    for i, (u, count) in enumerate(order):
        total, unit_dense, unit_expert = sums[u]
        if before + count * total < threshold:  # the whole run stays below: offloaded
            before += count * total
            dense += count * unit_dense
            expert += count * unit_expert
            continue
        # the unit in the run that reaches the threshold: the first whose end does
        skip = 0
        if total:
            skip = min(max(math.ceil((threshold - before) / total) - 1, 0), count - 1)
            while skip and before + skip * total >= threshold:
                skip -= 1
            while before + (skip + 1) * total < threshold:
                skip += 1
        before += skip * total
        dense += skip * unit_dense
        expert += skip * unit_expert
        for position, (size, is_expert) in enumerate(shards[u]):
            before += size
            if is_expert:
                expert += size
            else:
                dense += size
            if before >= threshold:
                last_unit = i == len(order) - 1 and skip == count - 1
                if last_unit and position == len(shards[u]) - 1:  # every tensor: the shard
                    return whole
                return dense, expert
    return whole
