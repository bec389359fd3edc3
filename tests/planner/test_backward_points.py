"""The backward's candidate points: the few the estimator keeps hold the largest total of every
layer's backward, for any mix of dense and MoE layers, block size and byte sizes."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from headroom import planner
from headroom.planner.activations import LayerTemporaries, backward_points
from headroom.planner.estimator import knobs, stage_terms_from_knobs
from headroom.planner.phases import layer_peak, stage_layer_backward, through_layers
from headroom.planner.states import LayerGrads

Kind = tuple[int, int]  # (dense, MoE)
Triple = tuple[int, int, int]
Quad = tuple[int, int, int, int]
Sext = tuple[int, int, int, int, int, int]


class Case(NamedTuple):
    flags: tuple[bool, ...]  # the stage's layers, MoE or dense
    k: int | None  # layers per recomputed block
    sizes: tuple[int, int, int, int]  # a dense, an MoE layer's saved; dispatch; checkpoint
    grads: Kind  # a layer's gradients
    own: tuple[Triple, Triple]  # its MLP's at the MLP's peak, in all, and at its start, per kind
    # held throughout, during the MLP's, freed, at its start (0: none), as the MLP's ends,
    # its dispatch buffers freed with its MLP's, per kind
    temporaries: tuple[Sext, Sext]
    edges: bool  # the bottom and top layers hold what others do not (FSDP2)
    held: Quad  # held by a layer in the middle, at the bottom, at the top, the only one
    released: Kind  # less per layer above, per kind


def _held(case: Case, j: int) -> int:
    """What a framework holds at layer j's backward (``through_layers``' ``held``)."""
    n = len(case.flags)
    edge = (j == 0) + 2 * (j == n - 1) if case.edges else 0
    above = [int(f) for f in case.flags[j + 1 :]]
    released = (len(above) - sum(above)) * case.released[0] + sum(above) * case.released[1]
    return case.held[edge] - released


def _every_layer(case: Case) -> int:
    """The largest total over each layer's backward, walked layer by layer; at layer j's, the
    largest of its start (where it holds anything there: those temporaries and its gradients
    made by then), its MLP's backward (its temporaries and a share of its own gradients) and
    the end of it (all of its MLP's gradients, its saved tensors freed, what it holds there)."""
    flags, k, sizes, grads, own, temporaries = case[:6]
    a_dense, a_moe, dispatch, a_input = sizes
    n = len(flags)
    size = n if k is None else k
    best = None
    for j in range(n):
        kind = int(flags[j])
        b0 = j // size * size
        held = (b0 // size) * a_input if k is not None else 0
        held += sum(a_moe if flags[i] else a_dense for i in range(b0, j + 1))
        disp = sum(dispatch for i in range(b0, j + 1) if flags[i])
        above = sum(grads[int(flags[i])] for i in range(j + 1, n)) + _held(case, j)
        (share, whole, at_start), (throughout, mlp, freed, start, end, freed_dispatch) = (
            own[kind],
            temporaries[kind],
        )
        in_mlp = above + held + disp + throughout + mlp + share
        after_mlp = above + held + disp + throughout + whole - freed - freed_dispatch + end
        starting = above + held + disp + throughout + start + at_start if start else in_mlp
        best = max(in_mlp, after_mlp, starting, best if best is not None else in_mlp)
    assert best is not None
    return best


def _first_largest(case: Case) -> Quad | None:
    """(grads, activations, dispatch, held) at the first layer whose backward holds the most,
    walked layer by layer, each layer at its own peak (``layer_peak``)."""
    flags, k, sizes, grads, own, temporaries = case[:6]
    a_dense, a_moe, dispatch, a_input = sizes
    peaks = [
        layer_peak(
            LayerGrads(layer=0, mlp_peak=share, mlp=whole, start=at_start),
            LayerTemporaries(*temps),
        )
        for (share, whole, at_start), temps in zip(own, temporaries, strict=True)
    ]
    n = len(flags)
    size = n if k is None else k
    best: Quad | None = None
    for j in range(n):
        b0 = j // size * size
        held = (b0 // size) * a_input if k is not None else 0
        held += sum(a_moe if flags[i] else a_dense for i in range(b0, j + 1))
        disp = sum(dispatch for i in range(b0, j + 1) if flags[i])
        above = sum(grads[int(flags[i])] for i in range(j + 1, n))
        own_grads, temps, freed = peaks[int(flags[j])]
        point = (above + own_grads, held + temps, disp + freed, _held(case, j))
        if best is None or sum(point) > sum(best):
            best = point
    return best


def _periodic(spec: tuple[int, int, int, list[int]]) -> tuple[bool, ...]:
    """``n`` layers, the first ``first`` dense, then an MoE layer every ``every``-th, some of
    them forced dense."""
    n, first, every, forced = spec
    return tuple(i >= first and (i - first) % every == 0 and i not in forced for i in range(n))


_SIZE = st.integers(0, 10**6)
_KIND = st.tuples(_SIZE, _SIZE)
_TRIPLE = st.tuples(_SIZE, _SIZE, _SIZE)
_CASES = st.builds(
    Case,
    flags=st.lists(st.booleans(), min_size=1, max_size=24).map(tuple)
    | st.tuples(st.integers(0, 4), st.integers(1, 30)).map(
        lambda d: (False,) * d[0] + (True,) * d[1]
    )
    | st.tuples(
        st.integers(1, 90),
        st.integers(0, 5),
        st.integers(1, 5),
        st.lists(st.integers(0, 90), max_size=4),
    ).map(_periodic),
    k=st.none() | st.integers(1, 30),
    sizes=st.tuples(_SIZE, _SIZE, _SIZE, _SIZE),
    grads=_KIND,
    own=st.tuples(_TRIPLE, _TRIPLE),
    temporaries=st.tuples(
        *[
            st.tuples(
                _SIZE, _SIZE, _SIZE, st.just(0) | _SIZE, st.just(0) | _SIZE, st.just(0) | _SIZE
            )
        ]
        * 2
    ),
    edges=st.booleans(),
    held=st.tuples(_SIZE, _SIZE, _SIZE, _SIZE),
    released=st.just((0, 0)) | _KIND,
)


#: six MoE layers in blocks of two, the stage's bottom and top layers holding nothing a middle
#: one holds: the largest backward is in the middle block's top layer, which a point of the
#: top block (more activations, held less) must not stand for (Hypothesis found it)
_MIDDLE_BLOCK = Case(
    flags=(True,) * 6,
    k=2,
    sizes=(0, 0, 2, 1),
    grads=(0, 0),
    own=((0, 0, 0), (0, 0, 0)),
    temporaries=((0,) * 6, (0,) * 6),
    edges=True,
    held=(2, 0, 0, 0),
    released=(0, 0),
)


@settings(max_examples=300, deadline=None)
@given(case=_CASES)
@example(case=_MIDDLE_BLOCK)
def test_the_kept_points_hold_the_largest_layer_backward(case: Case) -> None:
    points = backward_points(case.flags, case.k, *case.sizes, edges=case.edges)
    dense, moe = (
        layer_peak(
            LayerGrads(layer=0, mlp_peak=share, mlp=whole, start=at_start),
            LayerTemporaries(*temporaries),
        )
        for (share, whole, at_start), temporaries in zip(case.own, case.temporaries, strict=True)
    )
    held = case.held if case.edges else (case.held[0],) * 4
    kept = through_layers(points, 0, case.grads, (dense, moe), 0, 0, held, case.released)
    assert (sum(kept) if kept is not None else 0) == _every_layer(case)
    # and the same point: the first layer that holds the most (its split is what the budget
    # shows)
    assert kept == _first_largest(case)


@pytest.mark.parametrize("k", [None, 1, 2, 3, 4, 7, 16, 100, 1000])
@pytest.mark.parametrize(
    ("first", "every"), [(0, 1), (0, 2), (1, 3), (3, 7), (0, 64), (5, 4095)], ids=str
)
def test_periodic_layers_keep_few_points_however_many(
    first: int, every: int, k: int | None
) -> None:
    """4,096 layers with an MoE layer every ``every``-th one: the points repeat with the
    pattern, and only the ends of each run of them are kept (every other layer's was kept
    once: 2,048 points and more)."""
    flags = _periodic((4096, first, every, []))
    assert len(backward_points(flags, k, 9, 11, 3, 1)) <= 256


def test_a_uniform_stage_keeps_few_points() -> None:
    """Eighty identical layers checkpointed one by one: the first and last blocks only."""
    flags = (False,) * 80
    assert len(backward_points(flags, 1, 9, 0, 0, 1)) == 2
    assert len(backward_points(flags, 3, 9, 0, 0, 1)) <= 6
    assert len(backward_points(flags, None, 9, 0, 0, 1)) == 2
    # with the edges apart, the layers next to the bottom and the top too
    assert len(backward_points(flags, None, 9, 0, 0, 1, edges=True)) == 4
    assert len(backward_points(flags, 1, 9, 0, 0, 1, edges=True)) == 4


def test_a_block_as_deep_as_the_stage_does_not_hold_all_its_gradients() -> None:
    """One recomputed block of all the layers: the gradients of the block's own layers appear
    as its activations are freed, so the backward is not all gradients plus the whole block."""
    model = planner.load_model("llama-3-8b")
    pure = {"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"}
    spec = {"micro_batch_size": 1, "seq_len": 8192, "precision": pure}
    one_block = planner.load_train({**spec, "recompute": {"every_k": model.num_layers}})
    kn = knobs(one_block)
    coeffs = planner.calibrated_coefficients("runtime")
    t = stage_terms_from_knobs(model, kn, coeffs, 0)
    row = planner.estimate(model, one_block, planner.gpu("H200-141GB"), coeffs).gpu
    backward = row.phases["backward"].buckets
    grads, acts = t.states.layer_grads.dense, t.activations
    layers = model.num_layers * grads.layer
    # at the top of the block: the recomputed block, and of the layers' gradients only the top
    # layer's own MLP's, being made
    own, temporary, _ = layer_peak(grads, acts.temporaries.dense)
    assert 0 < own <= grads.mlp < grads.layer
    assert backward["grads"] == t.states.grads_start + own
    assert backward["activations"] >= model.num_layers * acts.layer.dense
    # the backward is the recomputed block, not the block plus every layer's gradients
    assert (
        backward["grads"] + backward["activations"] < layers + model.num_layers * acts.layer.dense
    )
    top = max(acts.backward_points, key=lambda p: p.activations)
    assert (top.dense_layers, top.moe_layers) == (0, 0)
    assert backward["activations"] == top.activations + temporary
    # the layers' backward the calibration compares with is this one
    assert stage_layer_backward(t.states, acts, t.in_flight) == (
        backward["grads"],
        backward["activations"],
        backward["moe_dispatch"],
        backward["transfer_buffers"],
    )
