"""The estimator reads one unit of each layer kind and counts it, never a unit per layer: its
work and the memory its caches keep do not grow with the number of layers.

Each stage's facts and the optimizer-offload walk are checked here against the per-layer walk
over ``planner.params.units`` (the inventory, one unit per layer, in module order), for
generated models with every kind of layer pattern: dense-first layers, an MoE layer every k-th,
layers forced dense one by one, multi-token-prediction modules.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from headroom import planner
from headroom.planner.estimator import stage_terms
from headroom.planner.params import _layer, _norm, count_params, units
from headroom.planner.stage import _local, offloaded_numel, stage_layer_ranges, stage_params


@st.composite
def layouts(draw: st.DrawFn) -> tuple[planner.ModelSpec, int, int, int]:
    """A model with a layer pattern, and a (tp, pp, ep) layout it can be split by."""
    layers = draw(st.integers(1, 40))
    experts = draw(st.sampled_from([4, 8]))
    fields: dict[str, Any] = {
        "vocab_size": draw(st.integers(100, 5000)),
        "hidden_size": 64 * draw(st.integers(1, 4)),
        "num_layers": layers,
        "num_heads": 4,
        "ffn_hidden_size": 64 * draw(st.integers(1, 4)),
        "norm": draw(st.sampled_from(["rmsnorm", "layernorm"])),
        "tied_embeddings": draw(st.booleans()),
        "linear_bias": draw(st.booleans()),
        "num_mtp_layers": draw(st.integers(0, 3)),
    }
    if draw(st.booleans()):
        fields["moe"] = {
            "num_experts": experts,
            "top_k": draw(st.integers(1, experts)),
            "expert_ffn_size": 64,
            "num_shared_experts": draw(st.integers(0, 1)),
            "dense_first_layers": draw(st.integers(0, min(layers, 3))),
            "layer_freq": draw(st.integers(1, 4)),
            "dense_layers": draw(st.lists(st.integers(0, layers + 3), max_size=6)),
            "router_bias": draw(st.booleans()),
        }
    model = planner.load_model(fields)
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, min(layers, 5)))
    ep = draw(st.sampled_from([1, 2, 4])) if model.moe is not None else 1
    return model, tp, pp, ep


def _per_layer(model: planner.ModelSpec, tp: int, pp: int, ep: int, stage: int) -> dict[str, Any]:
    """A stage's facts walked unit by unit, one per layer (as the estimator once did)."""
    all_units = units(model)
    layer_range = stage_layer_ranges(model.num_layers, pp)[stage]
    chosen = [all_units[0]] if stage == 0 else []
    chosen += [all_units[1 + i] for i in layer_range]
    if stage == pp - 1:
        head = all_units[-1]
        if model.tied_embeddings and stage > 0:  # the last stage's own copy of the matrix
            head = head._replace(tensors=(*head.tensors, *all_units[0].tensors))
        chosen.append(head)
    dense = expert = matrix = largest = 0
    order: list[tuple[int, bool]] = []
    unit_sizes = []
    for unit in chosen:
        unit_numel = 0
        for t in unit.tensors:
            rows, cols = _local(t, tp, ep)
            numel = rows * cols
            unit_numel += numel
            if t.kind == "expert":
                expert += numel
            else:
                dense += numel
            if t.is_matrix:
                matrix += numel
            largest = max(largest, rows * (cols // t.copies) if t.copies > 1 else numel)
            order.append((numel, t.kind == "expert"))
        unit_sizes.append(unit_numel)
    return {
        "dense_numel": dense,
        "expert_numel": expert,
        "matrix_numel": matrix,
        "largest_tensor_numel": largest,
        "unit_sizes": unit_sizes,
        "num_moe_layers": sum(u.is_moe for u in chosen),
        "order": order,
    }


def _offloaded(order: list[tuple[int, bool]], zd: int, ze: int, fraction: float) -> tuple[int, int]:
    """Megatron's walk tensor by tensor (the estimator's before it stepped over whole runs)."""
    sizes = [n // (ze if e else zd) for n, e in order]
    whole = sum(n for n, e in order if not e), sum(n for n, e in order if e)
    rounded = -(-whole[0] // zd), -(-whole[1] // ze)
    if fraction <= 0.0:
        return 0, 0
    if fraction >= 1.0:
        return rounded
    cut = bisect.bisect_left(list(accumulate(sizes)), sum(sizes) * fraction) + 1
    if cut >= len(sizes):
        return rounded
    dense = sum(s for s, (_, e) in zip(sizes[:cut], order[:cut], strict=True) if not e)
    expert = sum(s for s, (_, e) in zip(sizes[:cut], order[:cut], strict=True) if e)
    return dense, expert


@settings(max_examples=150, deadline=None)
@given(
    layout=layouts(),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    zero=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 8), (3, 5)]),
)
def test_each_kind_counted_is_the_walk_over_every_layer(
    layout: tuple[planner.ModelSpec, int, int, int],
    fractions: list[float],
    zero: tuple[int, int],
) -> None:
    model, tp, pp, ep = layout
    try:
        stage_params(model, tp, pp, ep, 0)
    except planner.SpecError:  # a layout the model cannot be split by
        return
    for stage in {0, pp // 2, pp - 1}:
        sp = stage_params(model, tp, pp, ep, stage)
        walked = _per_layer(model, tp, pp, ep, stage)
        assert sp.dense_numel == walked["dense_numel"]
        assert sp.expert_numel == walked["expert_numel"]
        assert sp.matrix_dense_numel + sp.matrix_expert_numel == walked["matrix_numel"]
        assert sp.largest_tensor_numel == walked["largest_tensor_numel"]
        assert sp.num_moe_layers == walked["num_moe_layers"] == sum(sp.moe_flags)
        assert sp.max_unit_numel >= max(walked["unit_sizes"])
        for fraction in [*fractions, 0.5, 1 - 1e-9]:
            assert offloaded_numel(sp, *zero, fraction) == _offloaded(
                walked["order"], *zero, fraction
            ), (stage, fraction)


@settings(max_examples=150, deadline=None)
@given(layout=layouts())
def test_parameter_counts_are_the_walk_over_every_layer(
    layout: tuple[planner.ModelSpec, int, int, int],
) -> None:
    model = layout[0]
    count = count_params(model)
    assert count.total == sum(u.numel for u in units(model))
    h = model.hidden_size
    mtp = 0
    for k in range(model.num_mtp_layers):
        index = model.num_layers + k
        mtp += 3 * sum(t.numel for t in _norm("n", model, h)) + 2 * h * h
        mtp += _layer(model, model.is_moe_layer(index), "mtp").numel
    assert count.mtp_excluded == mtp
    assert model.num_moe_layers == sum(model.is_moe_layer(i) for i in range(model.num_layers))


def _moe_4096(**moe: Any) -> dict[str, Any]:
    return {
        "name": "deep",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_layers": 4096,
        "num_heads": 32,
        "ffn_hidden_size": 11008,
        "moe": {"num_experts": 256, "top_k": 8, "expert_ffn_size": 2048, **moe},
    }


def test_a_stage_of_4096_layers_holds_no_unit_per_layer() -> None:
    """The stage's facts of a 4,096-layer MoE model: a byte per layer, four units' tensors."""
    model = planner.load_model(_moe_4096(layer_freq=3))
    sp = stage_params(model, 1, 1, 1, 0)
    assert isinstance(sp.moe_flags, bytes) and len(sp.moe_flags) == 4096
    assert len(sp.unit_tensors) == 4
    assert sum(map(len, sp.unit_tensors)) < 40
    assert sp.num_moe_layers == 1366 == model.num_moe_layers


def test_a_periodic_4096_layer_model_keeps_few_backward_points() -> None:
    """An MoE layer every third layer: the backward's points repeat with the pattern, so the
    estimator keeps the ends of each run of them, for every recompute block size."""
    model = planner.load_model(_moe_4096(layer_freq=3, dense_first_layers=1))
    hw = planner.gpu("H100-80GB")
    for recompute in ("none", {"every_k": 2}, {"every_k": 16}, {"every_k": 1000}, "full"):
        train = planner.load_train({"recompute": recompute})
        terms, _ = stage_terms(model, train, hw, 0)
        assert len(terms.activations.backward_points) <= 64, recompute
