"""The phase arithmetic: allocated bytes per GPU bucket in each phase of a step, from one
stage's named terms.

A step has phases. Step 1 runs forward and backward before any optimizer state exists; from
step 2 on the moments are resident throughout. Within backward, activations are freed layer by
layer while gradients appear: the backward peak is the largest of the loss's backward (logits
and their gradient), each layer's backward (the gradients of the layers above it, the saved
tensors up to it or, with recompute, the checkpoints below its block and the block re-run up to
it, and its own backward temporaries) and the embedding's. The optimizer phase adds the step's
own temporaries.

``_phase_terms`` states this arithmetic on a stage's named terms. ``phase_rows`` lays its terms
out per bucket (the Budget's per-bucket views and ``explain`` show the rows); ``largest_phase``
adds the same terms up per phase without building the rows (the auto-fit ladder's verdicts).
``stages_largest`` is the estimate's verdict: the same totals for a candidate's end stages from
their ``stage_constants`` (the sums of the persistent state, worked out once per state) and the
layers' terms under its batch shape (``planner.activations.layer_shape``), without building a
stage's activation terms or backward points. ``tests/planner/test_properties.py`` holds both
to the rows' sums (``phase_totals``).
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner.activations import (
    ActivationInputs,
    ActivationTerms,
    BackwardPoint,
    LayerTemporaries,
    ManyPoints,
    block_layers,
    layer_shape,
    point_layout,
    recomputed,
)
from headroom.planner.coefficients import Coefficients
from headroom.planner.model import ModelSpec
from headroom.planner.states import LayerGrads, ModelStates

#: builds a named tuple from a tuple of its fields without calling its ``__new__``
_new = tuple.__new__

#: allocated bytes per GPU bucket in one phase, in ``planner.budget.ROW_BUCKETS`` order (plain
#: tuples: a search builds five per candidate, and a named tuple costs several times as much)
BucketRow = tuple[int, int, int, int, int, int, int, int, int]
#: one ``BucketRow`` per phase, in ``PHASES`` order
PhaseRows = tuple[BucketRow, BucketRow, BucketRow, BucketRow, BucketRow]


def layer_peak(grads: LayerGrads, temporaries: LayerTemporaries) -> tuple[int, int, int]:
    """What a layer's backward holds at its peak beyond its saved tensors: (its own gradients
    made by then, its temporaries then less its MLP's saved tensors once freed, less its
    dispatch buffers once freed).

    The peak is the largest of: as it starts (an MoE layer, on its routed experts' outputs: of
    its gradients only its shared experts'), during its MLP's backward (the MLP's temporaries
    and the share of its gradients made by then), or once that is done (all of the MLP's
    gradients, its saved tensors freed, and what an MoE layer's routed experts hold as their
    backward ends)."""
    throughout = temporaries.throughout
    # nothing held before the routed experts' backward but what it holds later
    at_start = grads.start if temporaries.start else 0
    in_mlp = temporaries.mlp + grads.mlp_peak
    starting = temporaries.start + at_start
    freed = temporaries.mlp_saved + temporaries.dispatch
    after_mlp = grads.mlp - freed + temporaries.end
    if in_mlp >= after_mlp and in_mlp >= starting:
        return grads.mlp_peak, throughout + temporaries.mlp, 0
    if starting > after_mlp:
        return at_start, throughout + temporaries.start, 0
    return grads.mlp, throughout - temporaries.mlp_saved + temporaries.end, -temporaries.dispatch


#: ``through_layers``' held bytes when nothing but the layers' own terms varies
NOTHING_HELD = (0, 0, 0, 0)


def through_layers(
    points: tuple[BackwardPoint, ...],
    grads_start: int,
    layer_grads: tuple[int, int],
    peaks: tuple[tuple[int, int, int], tuple[int, int, int]],
    other_activations: int,
    other_dispatch: int,
    held: tuple[int, int, int, int] = NOTHING_HELD,
    released: tuple[int, int] = (0, 0),
) -> tuple[int, int, int, int] | None:
    """(grads, activations, moe_dispatch, held) at the largest of the layers' backward points
    (None without layers; the first of equal points wins). Per kind (dense, MoE): a layer's
    gradients (``layer_grads``) and its backward's ``layer_peak`` (``peaks``). ``other_*`` is
    what the other micro-batches in flight keep of their forwards. ``held`` is what a
    framework holds at a layer's backward by the layer's ``edge`` (middle, bottom, top, the
    only layer), less ``released`` per layer above of each kind (FSDP2 without resharding
    after forward: the blocks whose backward is done are no longer gathered)."""
    best = None
    best_total = -1
    dense_grads, moe_grads = layer_grads
    dense_released, moe_released = released
    if isinstance(points, ManyPoints):
        points = _kinds_best(points, dense_grads - dense_released, moe_grads - moe_released)
    # unpacked rather than read by attribute: this loop is most of a search's time
    for dense_layers, moe_layers, activations, dispatch, is_moe, edge in points:
        own_grads, temporaries, freed = peaks[is_moe]
        grads = grads_start + dense_layers * dense_grads + moe_layers * moe_grads + own_grads
        activations += other_activations + temporaries
        dispatch += other_dispatch + freed
        kept = held[edge] - dense_layers * dense_released - moe_layers * moe_released
        total = grads + activations + dispatch + kept
        if total > best_total:
            best, best_total = (grads, activations, dispatch, kept), total
    return best


def _kinds_best(points: ManyPoints, dense_grads: int, moe_grads: int) -> tuple[BackwardPoint, ...]:
    """The first point of each kind and edge with the most gradients (less what it releases),
    activations and dispatch, in their order (remembered by the points). Everything else a
    point's total adds is the same for every point of its kind and edge, so the first largest
    of all is one of these: a search through a stage of irregular layers walks its points
    once per pair of layer gradients, not once per candidate."""
    key = (dense_grads, moe_grads)
    hit = points.best.get(key)
    if hit is not None:
        return hit
    # a group's first point is its best so far whatever its total, which is negative where the
    # layers above release more than their gradients add (FSDP2 without resharding)
    top = [0] * 8
    where = [-1] * 8
    for i, (dense_layers, moe_layers, activations, dispatch, is_moe, edge) in enumerate(points):
        total = dense_layers * dense_grads + moe_layers * moe_grads + activations + dispatch
        group = 2 * edge + is_moe
        if where[group] < 0 or total > top[group]:
            top[group], where[group] = total, i
    best = tuple(points[i] for i in sorted(where) if i >= 0)
    points.remember(key, best)
    return best


def stage_layer_backward(
    states: ModelStates, acts: ActivationTerms, in_flight: int
) -> tuple[int, int, int, int] | None:
    """``through_layers`` of one stage with ``in_flight`` micro-batches: (grads, activations,
    moe_dispatch, transfer_buffers) at the largest of its layers' backward points."""
    dense, moe = states.layer_grads
    temporaries = acts.temporaries
    # the peaks of the kinds of layer the stage holds (its points are of those kinds only)
    sp = states.stage_params
    if not sp.num_moe_layers:
        peaks = (layer_peak(dense, temporaries.dense),) * 2
    elif sp.num_moe_layers == sp.num_layers:
        peaks = (layer_peak(moe, temporaries.moe),) * 2
    else:
        peaks = (layer_peak(dense, temporaries.dense), layer_peak(moe, temporaries.moe))
    extra = in_flight - 1  # micro-batches in flight besides the running one
    return through_layers(
        acts.backward_points,
        states.grads_start,
        (dense.layer, moe.layer),
        peaks,
        extra * acts.activations_saved,
        extra * acts.dispatch_saved,
        states.layer_transfer,
        states.released_transfer,
    )


def _phase_terms(
    states: ModelStates,
    acts: ActivationTerms,
    in_flight: int,
    streaming: bool,
    accumulating: bool,
) -> tuple[int, int, int, int, tuple[int, int, int, int, int]]:
    """What ``phase_rows`` and ``largest_phase`` read beyond the states' own buckets: (live
    gradients, activations, dispatch, transfer) through forward, and (grads, activations,
    logits, dispatch, transfer) at the backward's largest point."""
    transfer = states.transfer_buffers
    logits = acts.logits_forward
    activations = in_flight * acts.activations_saved
    dispatch = in_flight * acts.dispatch_saved
    # streaming: the head runs on its pool buffer and its input is held for its gradient
    if streaming and logits:
        activations += acts.layer.layer_input
    # gradient buffers live from the first micro-batch on (streaming's are the host's)
    live_grads = (
        states.grads_total if (accumulating or states.grads_resident) and not streaming else 0
    )
    # streaming: gradients drain to the host during a forward only after an earlier
    # micro-batch's backward
    forward_transfer = states.forward_transfer if accumulating or not streaming else 0

    # The backward's largest point (the earlier on a tie): the embedding's, every layer's
    # activations gone; a layer's; or the loss's, which runs before any gradient of a
    # parameter exists (the head's own follows it) unless the buffers are already live.
    # grads, activations, logits, dispatch, transfer
    back = (states.grads_tail, 0, 0, 0, transfer)
    layer = stage_layer_backward(states, acts, in_flight)
    if layer is not None and sum(layer) > sum(back):
        back = (layer[0], layer[1], 0, layer[2], layer[3])
    if states.head_reduced is not None:  # FSDP2's head group reduced after the loss
        head_grads, head_transfer = states.head_reduced
        reduced = (head_grads, activations, 0, dispatch, head_transfer)
        if sum(reduced) > sum(back):
            back = reduced
    if logits:
        loss_transfer = states.loss_transfer
        loss_logits = logits + acts.logits_backward
        loss = (live_grads, activations, loss_logits, dispatch, loss_transfer)
        if sum(loss) > sum(back):
            back = loss
    return live_grads, activations, dispatch, forward_transfer, back


def step_grads(states: ModelStates) -> int:
    """The gradients the optimizer step reads (``ModelStates.step_grads``)."""
    return states.grads_total if states.step_grads is None else states.step_grads


def phase_rows(
    states: ModelStates,
    acts: ActivationTerms,
    in_flight: int,
    streaming: bool,
    accumulating: bool,
) -> PhaseRows:
    """Allocated bytes per GPU bucket in each phase of one stage with ``in_flight``
    micro-batches (see the module docstring)."""
    params, master, ema = states.params, states.master_params, states.ema
    transfer, opt = states.transfer_buffers, states.optimizer_states
    logits = acts.logits_forward
    live_grads, activations, dispatch, forward_transfer, back = _phase_terms(
        states, acts, in_flight, streaming, accumulating
    )
    grads, back_activations, back_logits, back_dispatch, back_transfer = back

    if streaming:  # the CPU updates each layer as its gradients land
        optimizer = (params, 0, master, 0, ema, 0, 0, 0, transfer)
    else:  # ZeRO-3's gathered units are released once backward is done
        optimizer_states = opt + states.optimizer_temporaries
        optimizer = (params, step_grads(states), master, optimizer_states, ema, 0, 0, 0, 0)
    # fmt: off
    # params, grads, master_params, optimizer_states, ema, activations, logits, moe_dispatch,
    # transfer_buffers (ROW_BUCKETS); step 1 has no optimizer states yet
    return (
        (params, live_grads, master, 0, ema, activations, logits, dispatch, forward_transfer),
        (params, grads, master, 0, ema, back_activations, back_logits, back_dispatch,
         back_transfer),
        (params, live_grads, master, opt, ema, activations, logits, dispatch, forward_transfer),
        (params, grads, master, opt, ema, back_activations, back_logits, back_dispatch,
         back_transfer),
        optimizer,
    )
    # fmt: on


def largest_phase(
    states: ModelStates,
    acts: ActivationTerms,
    in_flight: int,
    streaming: bool,
    accumulating: bool,
) -> tuple[int, int]:
    """(allocated bytes, index in ``PHASES``) of the largest of ``phase_rows``' phases, the
    first on a tie: each phase's total added up from the same terms without building its row
    (the verdict reads nothing else; ``tests/planner/test_properties.py`` holds it to the
    rows' sums)."""
    live_grads, activations, dispatch, forward_transfer, back = _phase_terms(
        states, acts, in_flight, streaming, accumulating
    )
    held = states.params + states.master_params + states.ema  # in every phase
    opt = states.optimizer_states  # from step 2 on
    forward = held + live_grads + activations + acts.logits_forward + dispatch + forward_transfer
    backward = held + sum(back)
    if streaming:
        optimizer = held + states.transfer_buffers
    else:
        optimizer = held + step_grads(states) + opt + states.optimizer_temporaries
    totals = (forward, backward, forward + opt, backward + opt, optimizer)
    largest = max(totals)
    return largest, totals.index(largest)


def phase_totals(rows: PhaseRows) -> list[int]:
    """Allocated bytes of each phase (``PHASES`` order): the sums of its rows."""
    return list(map(sum, rows))


class StageConstants(NamedTuple):
    """What ``stages_largest`` reads of one stage: its layers, and the sums of its persistent
    state that no activation term changes (``_phase_terms``' and ``largest_phase``'s), worked
    out once per state."""

    num_layers: int
    num_moe_layers: int
    has_head: bool
    moe_flags: bytes  # the stage's layer kinds (``StageParams.moe_flags``)
    held: int  # parameters, master weights and EMA: held in every phase
    optimizer_states: int  # held from step 2 on
    forward: int  # the forward's total besides the activations, logits and dispatch buffers
    optimizer: int  # the optimizer phase's total
    tail: int  # the backward's total at the embedding's point
    loss: int  # the loss's backward point's besides the activations, logits and dispatch
    head_reduced: int | None  # FSDP2's head group's reduction's, the same (None: no such point)
    grads_start: int  # the gradients as the layers' backward starts
    dense_mlp_peak: int  # a dense layer's ``LayerGrads``: ``mlp_peak``
    dense_mlp: int  # and ``mlp``
    moe_mlp_peak: int  # an MoE layer's: ``mlp_peak``
    moe_mlp: int  # ``mlp``
    moe_start: int  # and ``start``
    dense_step: int  # what each dense layer above the running one adds (gradients less
    # what its release frees)
    moe_step: int  # the same for an MoE layer
    layer_transfer: tuple[int, int, int, int]  # at a layer's backward, by its edge


#: an upper bound of the bytes a ``StageConstants`` holds beyond its state's (a cache entry's
#: weight, ``planner._memo``)
CONSTANTS_BYTES = 1024


def stage_constants(states: ModelStates, streaming: bool, accumulating: bool) -> StageConstants:
    """The sums ``stages_largest`` reads of a stage with persistent state ``states``."""
    sp = states.stage_params
    held = states.params + states.master_params + states.ema
    grads_total, opt = states.grads_total, states.optimizer_states
    # gradient buffers live from the first micro-batch on (streaming's are the host's)
    live_grads = grads_total if (accumulating or states.grads_resident) and not streaming else 0
    # streaming: gradients drain to the host during a forward only after an earlier
    # micro-batch's backward
    forward_transfer = states.forward_transfer if accumulating or not streaming else 0
    if streaming:
        optimizer = held + states.transfer_buffers
    else:
        optimizer = held + step_grads(states) + opt + states.optimizer_temporaries
    head_reduced = None
    if states.head_reduced is not None:
        head_reduced = sum(states.head_reduced)
    dense_grads, moe_grads = states.layer_grads
    dense_released, moe_released = states.released_transfer
    return StageConstants(
        num_layers=sp.num_layers,
        num_moe_layers=sp.num_moe_layers,
        has_head=sp.has_head,
        moe_flags=sp.moe_flags,
        held=held,
        optimizer_states=opt,
        forward=held + live_grads + forward_transfer,
        optimizer=optimizer,
        tail=states.grads_tail + states.transfer_buffers,
        loss=live_grads + states.loss_transfer,
        head_reduced=head_reduced,
        grads_start=states.grads_start,
        dense_mlp_peak=dense_grads.mlp_peak,
        dense_mlp=dense_grads.mlp,
        moe_mlp_peak=moe_grads.mlp_peak,
        moe_mlp=moe_grads.mlp,
        moe_start=moe_grads.start,
        dense_step=dense_grads.layer - dense_released,
        moe_step=moe_grads.layer - moe_released,
        layer_transfer=states.layer_transfer,
    )


class StageAllocated(NamedTuple):
    """One stage's largest phase."""

    allocated_bytes: int  # its allocated bytes (the sum of its row)
    phase_index: int  # index of the phase in PHASES


def stages_largest(
    model: ModelSpec,
    coeffs: Coefficients,
    stages: tuple[StageConstants, ...],
    inputs: ActivationInputs,
    in_flights: tuple[int, ...],
    streaming: bool,
) -> tuple[StageAllocated, ...]:
    """``largest_phase`` of each of ``stages`` (its ``stage_constants``) with ``in_flights[i]``
    micro-batches in flight, its activation terms under ``inputs`` worked out on the way: the
    same sums, without building a stage's ``ActivationTerms`` or its backward points (a search
    pays this for every new candidate). Only each phase's total is kept, so the backward's
    largest point is the largest of its candidates' totals, and each layer's backward point
    adds up only what differs from point to point."""
    shape = layer_shape(model, coeffs, inputs)
    k, edges = block_layers(inputs), inputs.edges
    saved_dense, saved_moe, throughout_dense, throughout_moe, checkpoint = recomputed(shape, inputs)
    # unpacked rather than read by attribute (fields in declaration order)
    (
        _,
        _,
        _,
        dispatch,
        layer_input,
        _,
        _,
        ffn_dense,
        ffn_moe,
        start_moe,
        end_moe,
        mlp_dense,
        mlp_moe,
        end_dense,
    ) = shape.layer
    moe_held = saved_moe + dispatch  # what each MoE layer of a block holds
    head_saved, logits_forward, logits_backward = shape.head
    out = []
    for constants, in_flight in zip(stages, in_flights, strict=True):
        (
            n,
            n_moe,
            has_head,
            flags,
            held,
            opt,
            forward,
            optimizer,
            back,  # the backward's largest point so far: the embedding's (``tail``)
            loss,
            head_reduced,
            grads_start,
            dense_mlp_peak,
            dense_mlp,
            moe_mlp_peak,
            moe_mlp,
            moe_start,
            dense_step,
            moe_step,
            layer_transfer,
        ) = constants
        # one micro-batch's saved activations and dispatch buffers (``stage_activation_terms``)
        if k is None:
            saved = (n - n_moe) * saved_dense + n_moe * saved_moe
            dispatch_saved = n_moe * dispatch
        else:
            saved = -(-n // k) * checkpoint
            dispatch_saved = 0
        logits = 0
        if has_head:
            saved += head_saved
            logits = logits_forward
        activations = in_flight * saved
        dispatch_all = in_flight * dispatch_saved
        # streaming: the head runs on its pool buffer and its input is held for its gradient
        if streaming and logits:
            activations += layer_input
        layouts = point_layout(flags, k, edges)
        if layouts:
            # ``stage_layer_backward``: the largest point's total, less what every point adds.
            # A kind's ``layer_peak`` adds up to the largest of its three moments (in its MLP's
            # backward, as it starts, after its MLP's), for the kinds the stage holds
            dense_peak = moe_peak = 0
            if n_moe < n:
                dense_peak = throughout_dense + max(
                    ffn_dense + dense_mlp_peak, 0, dense_mlp - mlp_dense + end_dense
                )
            if n_moe:
                moe_peak = throughout_moe + max(
                    ffn_moe + moe_mlp_peak,
                    start_moe + moe_start if start_moe else 0,
                    moe_mlp - mlp_moe - dispatch + end_moe,
                )
            # what every point adds: the gradients as the layers' backward starts, and what
            # the micro-batches in flight besides the running one keep of their forwards
            extra = in_flight - 1
            common = grads_start + extra * saved + extra * dispatch_saved
            # a point counts once its total is above -1 (``through_layers``' start)
            best = -1 - common
            for (
                dense_layers,
                moe_layers,
                checkpoints,
                held_dense,
                held_moe,
                is_moe,
                edge,
            ) in layouts:
                total = (
                    dense_layers * dense_step
                    + moe_layers * moe_step
                    + checkpoints * checkpoint
                    + held_dense * saved_dense
                    + held_moe * moe_held
                    + layer_transfer[edge]
                    + (moe_peak if is_moe else dense_peak)
                )
                if total > best:
                    best = total
            best += common
            if best > back and best >= 0:  # -1: no point counted
                back = best
        if head_reduced is not None:  # FSDP2's head group reduced after the loss
            reduced = head_reduced + activations + dispatch_all
            if reduced > back:
                back = reduced
        if logits:
            loss += activations + logits + logits_backward + dispatch_all
            if loss > back:
                back = loss
        forward += activations + logits + dispatch_all
        back += held
        # the first largest of (forward, backward, forward + opt, backward + opt, optimizer):
        # step 2's forward and backward are step 1's plus the moments, so they are larger
        # when there are moments, and equal (the earlier wins) when there are none
        if back > forward:
            largest, index = back, 1
        else:
            largest, index = forward, 0
        if opt > 0:
            largest += opt
            index += 2
        if optimizer > largest:
            largest, index = optimizer, 4
        out.append(_new(StageAllocated, (largest, index)))
    return tuple(out)
