"""The estimator: per-bucket bytes on the heaviest rank, phase by phase, and the verdict.

A step has phases. Step 1 runs forward and backward before any optimizer state exists; from
step 2 on the moments are resident throughout. Within backward, activations are freed layer by
layer while gradients appear: the backward peak is the largest of the loss's backward (logits
and their gradient), each layer's backward (the gradients of the layers above it, the saved
tensors up to it or, with recompute, the checkpoints below its block and the block re-run up to
it, and its own backward temporaries) and the embedding's. The optimizer phase adds the step's
own temporaries. The reported peak is the largest
phase total, never the sum of the buckets' separate maxima.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from headroom.planner import buckets as b
from headroom.planner._memo import identity_memo
from headroom.planner.activations import LayerActivations, layer_activations
from headroom.planner.budget import PHASES, Budget
from headroom.planner.coefficients import Coefficients, default_coefficients
from headroom.planner.errors import SpecError
from headroom.planner.hardware import Hardware
from headroom.planner.model import ModelSpec
from headroom.planner.stage import StageParams, offloaded_numel, stage_params
from headroom.planner.train import BYTES_PER_ELEMENT, TrainSpec

_DEFAULT_CAPACITY_FACTOR = 1.25


class StageTerms(NamedTuple):
    """Every intermediate quantity of one stage's estimate (``explain`` reads these)."""

    sp: StageParams
    acts: LayerActivations
    in_flight: int
    checkpoint_every: int | None
    zero_dense: tuple[int, int, int]  # shards of params, grads, optimizer (ZeRO-3/2/1)
    zero_expert: tuple[int, int, int]
    offloaded_numel: int
    gpu_updated_numel: int
    params: int
    grads_total: int
    grads_start: int  # when the layers' backward starts (the head's, a tied table's pending
    # gradient, or all when accumulating)
    layer_grads_dense: int  # one dense layer's gradients, made during backward (0: already live)
    layer_grads_moe: int  # one MoE layer's
    own_grads_dense: int  # a dense layer's gradients at the peak of its MLP's backward
    own_grads_moe: int  # an MoE layer's
    mlp_grads_dense: int  # all of a dense layer's MLP gradients (once its MLP's backward is done)
    mlp_grads_moe: int  # all of an MoE layer's experts' gradients
    start_grads_moe: int  # an MoE layer's as its routed experts' backward starts (its shared
    # experts', computed last in forward, are made first)
    grads_tail: int  # at the embedding's backward: its gradient being made and accumulated
    master_params: int
    optimizer_states: int
    optimizer_temporaries: int
    ema: int
    transfer_buffers: int
    activations_saved: int  # per micro-batch, at the end of forward
    dispatch_saved: int  # per micro-batch
    # at the peak of each backward step that can be the largest: (dense layers, MoE layers)
    # whose gradients exist, the micro-batch's activations and dispatch buffers then, and
    # whether the layer running is an MoE layer (1) or dense (0)
    backward_points: tuple[tuple[int, int, int, int, int], ...]
    # what a dense and an MoE layer's backward holds beyond its saved tensors, per kind
    # (dense, MoE): held throughout its backward, during its MLP's only, its MLP's saved
    # tensors (freed by then), held as it starts (an MoE layer's, on its experts' outputs,
    # before any routed expert's gradient) and as its MLP's backward ends (an MoE layer's
    # routed experts' input gradients)
    layer_temporaries: tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]
    logits_forward: int
    logits_backward: int
    host: tuple[int, int, int, int, int, int]  # HOST_BUCKETS order, per rank


class Knobs(NamedTuple):
    """A training spec flattened to the scalars the estimate reads, resolved once per spec.

    A search (the auto-fit ladder) varies these directly with ``_replace`` instead of validating
    a new ``TrainSpec`` per candidate; ``knobs(train)`` is the only way to make one from a spec.
    """

    micro_batch: int
    seq_len: int
    grad_accum: int
    bp: int  # bytes per working param
    bg: int  # bytes per grad, plus the working-precision grad when accumulating in fp32
    bm: int  # bytes per master param
    bo: int  # bytes per optimizer-state element
    optimizer: str
    optimizer_impl: str
    eager: bool
    ema: str
    dp: int
    tp: int
    pp: int
    ep: int
    cp: int
    sequence_parallel: bool
    zero: int
    offload: str  # none | optimizer | streaming
    fraction: float
    num_buffers: int
    selective: bool
    checkpoint_every: int | None  # layers per recomputed block (full recompute: 1)
    capacity_factor: float | None
    imbalance: float
    expandable_segments: bool
    activation_profile: str
    clip: bool  # global-norm clipping: streaming's CPU update waits for the step's norm


@identity_memo(4096)
def knobs(train: TrainSpec) -> Knobs:
    """The scalars of ``train`` the estimate reads (memoised per spec object)."""
    p, prec, off = train.parallel, train.precision, train.offload
    _check(train)
    bp = BYTES_PER_ELEMENT[prec.params]
    bg = BYTES_PER_ELEMENT[prec.grads]
    if bg > bp:
        # fp32 accumulation: autograd still produces working-precision grads, accumulated
        # into an fp32 buffer (the seeds' 20 B/param case)
        bg += bp
    k = train.checkpoint_every
    if train.recompute == "full" and k is None:
        k = 1
    return Knobs(
        train.micro_batch_size,
        train.seq_len,
        train.grad_accum_steps,
        bp,
        bg,
        BYTES_PER_ELEMENT[prec.master],
        BYTES_PER_ELEMENT[prec.optimizer_states],
        train.optimizer,
        train.optimizer_impl,
        train.attention == "eager",
        train.ema,
        p.dp,
        p.tp,
        p.pp,
        p.ep,
        p.cp,
        p.sequence_parallel,
        p.zero_stage,
        off.mode,
        off.fraction,
        off.num_buffers,
        train.recompute == "selective",
        k,
        train.moe_capacity_factor,
        train.moe_imbalance,
        train.expandable_segments,
        train.activation_profile,
        train.max_grad_norm is not None,
    )


def _check(train: TrainSpec) -> None:
    p = train.parallel
    if train.offload.mode == "streaming" and (p.tp > 1 or p.pp > 1):
        raise SpecError(
            "offload.mode: streaming runs one layer stream per GPU; it needs parallel.tp=1 and "
            f"parallel.pp=1, got tp={p.tp} pp={p.pp}",
            field="offload.mode",
        )


def _model_states(
    sp: StageParams,
    ep: int,
    dp: int,
    z: int,
    bp: int,
    bg: int,
    bm: int,
    bo: int,
    optimizer: str,
    optimizer_impl: str,
    ema: str,
    offload: str,
    fraction: float,
    num_buffers: int,
    accumulating: bool,
    own_fraction: float,
) -> tuple[Any, ...]:
    """Persistent state of one stage's rank: StageTerms fields zero_dense .. transfer_buffers,
    then the host tuple. ``dp`` is the data-parallel group including context parallelism."""
    streaming = offload == "streaming"
    edp = dp // ep
    if streaming:  # host holds every persistent byte; ZeRO has nothing to shard on the GPU
        zd = ze = (1, 1, 1)
    else:
        zd = (dp if z >= 3 else 1, dp if z >= 2 else 1, dp if z >= 1 else 1)
        ze = (edp if z >= 3 else 1, edp if z >= 2 else 1, edp if z >= 1 else 1)
    dense, expert = sp.dense_numel, sp.expert_numel

    # Model states, local shard, before placement: dense tensors shard over dp x cp, experts
    # over the expert-data-parallel group.
    opt_total = b.optimizer_state_bytes(
        optimizer,
        dense,
        bo,
        matrix_numel=sp.matrix_dense_numel,
        adafactor_numel=sp.adafactor_dense_numel,
        adam8bit_bytes=sp.adam8bit_dense_bytes,
        zero1_shards=zd[2],
    ) + b.optimizer_state_bytes(
        optimizer,
        expert,
        bo,
        matrix_numel=sp.matrix_expert_numel,
        adafactor_numel=sp.adafactor_expert_numel,
        adam8bit_bytes=sp.adam8bit_expert_bytes,
        zero1_shards=ze[2],
    )
    local_opt_numel = -(-dense // zd[2]) + -(-expert // ze[2])
    master_total = b.master_params_bytes(dense, bm, zd[2]) + b.master_params_bytes(
        expert, bm, ze[2]
    )
    ema_total = b.ema_bytes(dense, zd[2]) + b.ema_bytes(expert, ze[2]) if ema != "none" else 0

    # bytes of a gradient as autograd produces it (fp32 accumulation adds a buffer to it)
    bw = bp if bg > bp else bg
    if streaming:
        # the device holds autograd's gradients only; the fp32 accumulator is the host's
        unit = sp.max_unit_numel
        params = num_buffers * unit * bp
        grads_total = grads_start = grads_tail = unit * bw
        # they land in the one unit counted
        layer_dense = layer_moe = own_dense = own_moe = mlp_dense = mlp_moe = 0
        start_moe = 0
        transfer = 2 * unit * bw  # gradient slabs draining to the host
        master = opt = opt_temp = ema_gpu = 0
        off = local_opt_numel
        gpu_updated = 0
        numel = dense + expert
        host = (numel * bp, numel * 4, master_total, opt_total, ema_total, 2 * unit * bg)
    else:
        params = b.params_bytes(dense, bp, zd[0]) + b.params_bytes(expert, bp, ze[0])
        grads_total = b.grads_bytes(dense, bg, zd[1]) + b.grads_bytes(expert, bg, ze[1])
        if offload == "optimizer":
            off_d, off_e = offloaded_numel(sp, zd[2], ze[2], fraction)
            off = off_d + off_e
        else:
            off = 0
        gpu_updated = local_opt_numel - off
        opt = int(opt_total * (gpu_updated / local_opt_numel)) if local_opt_numel else 0
        master = gpu_updated * bm
        opt_temp = (
            b.optimizer_temporary_bytes(
                optimizer,
                optimizer_impl,
                gpu_updated,
                sp.largest_tensor_numel,
                sp.largest_matrix_numel,
                bo,
                4 if (bm == 4 and bg < 4) else 0,
                mixed_states=bm == 4 and bo < 4,
            )
            if gpu_updated
            else 0
        )
        ema_gpu = ema_total if ema == "gpu" else 0
        ema_host = ema_total if ema == "host" else 0
        # ZeRO-3 gathers full layers around compute: the layer in use and the one prefetched.
        transfer = 2 * (sp.max_unit_numel * bp) if (z >= 3 and dp > 1) else 0
        if accumulating:  # every gradient buffer is live from the first micro-batch on
            grads_start = grads_total
            layer_dense = layer_moe = own_dense = own_moe = mlp_dense = mlp_moe = start_moe = 0
        else:
            grads_start = b.grads_bytes(sp.head_unit_numel, bg, zd[1]) if sp.has_head else 0
            layer_dense = b.grads_bytes(sp.dense_layer_numel, bg, zd[1])
            layer_moe = b.grads_bytes(sp.moe_layer_numel, bg, zd[1]) + b.grads_bytes(
                sp.moe_layer_expert_numel, bg, ze[1]
            )
            # a layer's backward makes its MLP's gradients first: a share of them exists at the
            # peak of the MLP's backward, all of them once it is done
            mlp_dense = b.grads_bytes(sp.dense_layer_mlp_numel, bg, zd[1])
            mlp_moe = b.grads_bytes(sp.moe_layer_shared_numel, bg, zd[1]) + b.grads_bytes(
                sp.moe_layer_expert_numel, bg, ze[1]
            )
            own_dense = int(own_fraction * mlp_dense)
            own_moe = int(own_fraction * mlp_moe)
            start_moe = b.grads_bytes(sp.moe_layer_shared_numel, bg, zd[1])
        if sp.tied_embeddings:
            # the head's gradient of a tied table waits in autograd's input buffer for the
            # embedding's through every layer's backward (the tail below adds the two)
            grads_start += b.grads_bytes(sp.embedding_numel, bw, zd[1])
        if sp.has_embedding:
            embedding_grad = b.grads_bytes(sp.embedding_numel, bg, zd[1])
            # The embedding's backward makes a new table-sized gradient. A tied table already
            # holds the head's contribution in autograd's input buffer, and the engine adds the
            # two out of place (measured: three tables at once, on real and fake tensors);
            # accumulation adds into the existing .grad, one more table alive at that moment.
            # Those tables are autograd's (working precision); an fp32 accumulator of the
            # embedding is made when its gradient lands, after them, unless accumulating.
            extra = 2 * int(sp.tied_embeddings) + int(accumulating)
            working_table = b.grads_bytes(sp.embedding_numel, bw, zd[1])
            late = 0 if accumulating else embedding_grad - working_table
            grads_tail = grads_total - late + working_table * extra
        else:
            grads_tail = grads_total
        host = (0, off * 4, off * bm, opt_total - opt, ema_host, 0)
    return (
        zd,
        ze,
        off,
        gpu_updated,
        params,
        grads_total,
        grads_start,
        layer_dense,
        layer_moe,
        own_dense,
        own_moe,
        mlp_dense,
        mlp_moe,
        start_moe,
        grads_tail,
        master,
        opt,
        opt_temp,
        ema_gpu,
        transfer,
        host,
    )


def _activation_terms(
    model: ModelSpec,
    coeffs: Coefficients,
    sp: StageParams,
    tp: int,
    ep: int,
    cp: int,
    sequence_parallel: bool,
    micro_batch: int,
    seq_len: int,
    bp: int,
    eager: bool,
    capacity_factor: float | None,
    imbalance: float,
    selective: bool,
    k: int | None,
) -> tuple[Any, ...]:
    """Activations, dispatch buffers and logits of one stage's rank for one micro-batch:
    StageTerms fields activations_saved .. logits_backward, then the layer terms."""
    moe = model.moe
    cf = capacity_factor or (moe.capacity_factor if moe else None) or _DEFAULT_CAPACITY_FACTOR
    acts = layer_activations(
        model, coeffs, micro_batch, seq_len, bp, eager, tp, cp, ep, sequence_parallel, cf, imbalance
    )
    n, n_moe = sp.num_layers, sp.num_moe_layers
    a_dense, a_moe, a_scores, a_dispatch, a_input, t_dense, t_moe, f_dense, f_moe = acts[:9]
    t_dense -= f_dense  # held throughout the layer's backward; f_*: during its MLP's only
    t_moe -= f_moe
    if k is None:
        saved = (n - n_moe) * a_dense + n_moe * a_moe
        disp = n_moe * a_dispatch
        if selective:  # each layer recomputes its scores in its own backward
            saved -= n * a_scores
            a_dense -= a_scores
            a_moe -= a_scores
            t_dense += a_scores
            t_moe += a_scores
    else:
        saved = -(-n // k) * a_input
        disp = 0
        rerun = int(coeffs.recompute_hidden_tensors * a_input)
        t_dense += rerun
        t_moe += rerun
    points = _backward_points(sp.moe_flags, k, a_dense, a_moe, a_dispatch, a_input)
    temporaries = (
        (t_dense, f_dense, acts.mlp_dense, 0, 0),
        (t_moe, f_moe, acts.mlp_moe + a_dispatch, acts.backward_start_moe, acts.backward_end_moe),
    )
    logits_f = logits_b = 0
    if sp.has_head:
        tokens = micro_batch * -(-seq_len // cp)
        vocab_local = -(-model.vocab_size // tp)
        logits_f = b.logits_bytes(tokens, vocab_local, coeffs.logits_bytes_per_element)
        logits_b = b.logits_bytes(tokens, vocab_local, coeffs.logits_backward_bytes_per_element)
        if coeffs.head_hidden_tensors:
            whole = tp if sequence_parallel else 1
            saved += int(coeffs.head_hidden_tensors * tokens * model.hidden_size * bp) // whole
    return (saved, disp, points, temporaries, logits_f, logits_b, sp, acts)


def _backward_points(
    flags: tuple[bool, ...],
    k: int | None,
    a_dense: int,
    a_moe: int,
    a_dispatch: int,
    a_input: int,
) -> tuple[tuple[int, int, int, int, int], ...]:
    """Where one micro-batch's backward through the stage's layers can peak.

    At layer j's backward the gradients of the layers above j exist and j's own are being
    made; the micro-batch holds the saved tensors of the layers up to j (without recompute)
    or the checkpoints of the blocks below j's and the recomputed block up to j (j's own
    backward temporaries and gradients being made are the caller's, by kind). Each point is
    (dense layers, MoE layers) with gradients, activation bytes, dispatch bytes, and 1 if layer
    j is an MoE layer; which layers they are depends on the layout only (``_point_layout``).
    """
    return tuple(
        (
            dense,
            moe,
            ckpt * a_input + held_dense * a_dense + held_moe * a_moe,
            held_moe * a_dispatch,
            is_moe,
        )
        for dense, moe, ckpt, held_dense, held_moe, is_moe in _point_layout(flags, k)
    )


@functools.lru_cache(maxsize=1024)
def _point_layout(
    flags: tuple[bool, ...], k: int | None
) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """The layers ``_backward_points`` evaluates, as counts: (dense layers, MoE layers) with
    gradients, checkpoints held, (dense, MoE) layers of the recomputed or saved block up to it,
    and 1 if the layer is an MoE layer. Between two layers of one kind in one block the bytes
    change linearly, and so do they between consecutive blocks of the same shape, so the ends of
    such runs are the only candidates (a stage of one kind of layer has two to six)."""
    n = len(flags)
    if not n:
        return ()
    size = n if k is None else k
    if all(flags) or not any(flags):  # one kind: the bottom, last full and partial top blocks
        is_moe = int(flags[0])
        size = min(size, n)
        full = n // size
        uniform = []
        for b0 in sorted({0, (full - 1) * size, full * size} - {n}):
            checkpoints = 0 if k is None else b0 // size
            for layers in sorted({1, min(size, n - b0)}):
                above = n - b0 - layers
                if is_moe:
                    uniform.append((0, above, checkpoints, 0, layers, 1))
                else:
                    uniform.append((above, 0, checkpoints, layers, 0, 0))
        return tuple(uniform)
    # blocks from the first layer: [b0, b0 + size); runs of identical blocks keep their ends
    blocks = [(b0, flags[b0 : b0 + size]) for b0 in range(0, n, size)]
    chosen = [
        i
        for i, (_, shape) in enumerate(blocks)
        if i in (0, len(blocks) - 1) or shape != blocks[i - 1][1] or shape != blocks[i + 1][1]
    ]
    dense_above = [0] * (n + 1)  # dense_above[j]: dense layers at j or above
    for j in range(n - 1, -1, -1):
        dense_above[j] = dense_above[j + 1] + (not flags[j])
    points = []
    for i in chosen:
        b0, shape = blocks[i]
        checkpoints = 0 if k is None else b0 // size
        held = [0, 0]
        for offset, is_moe in enumerate(shape):
            j = b0 + offset
            held[is_moe] += 1
            last = offset == len(shape) - 1 or shape[offset + 1] != is_moe
            first = offset == 0 or shape[offset - 1] != is_moe
            if first or last:
                dense = dense_above[j + 1]
                moe = n - j - 1 - dense
                points.append((dense, moe, checkpoints, held[0], held[1], int(is_moe)))
    return tuple(points)


# Spec-dependent memo of ``_stage_parts``, keyed by the identity of the model and coefficients
# (kept alive in the entry) and the values of the knobs each half reads.
_CACHE_SIZE = 8192
_STATES: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_ACTS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _stage_parts(
    model: ModelSpec, kn: Knobs, coeffs: Coefficients, stages: tuple[int, ...]
) -> tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]:
    """Persistent state and activation terms of each of ``stages`` (one tuple each, in order).

    The two halves are memoised separately, so a search that varies the batch shape reuses the
    states and one that varies placement reuses the activations.
    """
    (
        micro_batch,
        seq_len,
        grad_accum,
        bp,
        bg,
        bm,
        bo,
        optimizer,
        optimizer_impl,
        eager,
        ema,
        dp,
        tp,
        pp,
        ep,
        cp,
        sequence_parallel,
        z,
        offload,
        fraction,
        num_buffers,
        selective,
        k,
        capacity_factor,
        imbalance,
        _,
        _,
        _,
    ) = kn
    streaming = offload == "streaming"
    key: tuple[Any, ...] = (
        id(model),
        stages,
        tp,
        pp,
        ep,
        dp * cp,
        z,
        bp,
        bg,
        bm,
        bo,
        optimizer,
        optimizer_impl,
        ema,
        offload,
        fraction if offload == "optimizer" else 0.0,
        num_buffers if streaming else 0,
        grad_accum > 1,
        coeffs.backward_mlp_grads,
    )
    hit = _STATES.get(key)
    if hit is None:
        if len(_STATES) >= _CACHE_SIZE:
            del _STATES[next(iter(_STATES))]
        states = tuple(
            _model_states(stage_params(model, tp, pp, ep, stage), *key[4:]) for stage in stages
        )
        hit = _STATES[key] = (model, states)
    states = hit[1]
    akey: tuple[Any, ...] = (
        id(model),
        id(coeffs),
        stages,
        pp,
        tp,
        ep,
        cp,
        sequence_parallel,
        micro_batch,
        seq_len,
        bp,
        eager,
        capacity_factor,
        imbalance,
        selective,
        k,
    )
    hit = _ACTS.get(akey)
    if hit is None:
        if len(_ACTS) >= _CACHE_SIZE:
            del _ACTS[next(iter(_ACTS))]
        acts = tuple(
            _activation_terms(model, coeffs, stage_params(model, tp, pp, ep, stage), *akey[4:])
            for stage in stages
        )
        hit = _ACTS[akey] = (model, coeffs, acts)
    acts = hit[-1]
    return states, acts


def _stage_terms(model: ModelSpec, kn: Knobs, coeffs: Coefficients, stage: int) -> StageTerms:
    """Every term of one stage (``explain`` and the Budget's per-bucket views read these)."""
    (states,), (acts,) = _stage_parts(model, kn, coeffs, (stage,))
    in_flight = min(kn.pp - stage, kn.grad_accum)
    return StageTerms._make(
        (acts[6], acts[7], in_flight, kn.checkpoint_every, *states[:-1], *acts[:6], states[-1])
    )


def _phase_totals(
    states: tuple[Any, ...], acts: tuple[Any, ...], m: int, streaming: bool, accumulating: bool
) -> tuple[int, int, int, int, int]:
    """Allocated bytes of each phase (PHASES order): the row sums of ``_phase_rows`` without
    building the rows (a property test holds the two to each other)."""
    (
        _,
        _,
        _,
        _,
        params,
        grads_total,
        grads_start,
        g_dense,
        g_moe,
        own_dense,
        own_moe,
        mlp_dense,
        mlp_moe,
        start_moe,
        grads_tail,
        master,
        opt,
        opt_temp,
        ema,
        transfer,
        _,
    ) = states
    saved, disp, points, temporaries, logits_f, logits_b, _, layer = acts
    base = params + master + ema + transfer
    live = m * (saved + disp)
    through = _through_layers(
        points,
        grads_start,
        (g_dense, g_moe),
        _layer_totals(((own_dense, mlp_dense, 0), (own_moe, mlp_moe, start_moe)), temporaries),
        live - saved - disp,
    )
    # the embedding's backward: every layer's activations are gone
    bwd = through if through > grads_tail else grads_tail
    if streaming:
        # the head runs on its pool buffer and its input is held for its gradient; no
        # gradient of a parameter exists until the loss's backward is done, and gradients
        # drain to the host during a forward only after an earlier micro-batch's backward
        head_input = layer.layer_input if logits_f else 0
        draining = transfer if accumulating else 0
        fwd = params + draining + live + head_input + logits_f
        loss = live + head_input + logits_f + logits_b - transfer
        if logits_f and loss > bwd:
            bwd = loss
        g_fwd = 0
    else:
        if logits_f:
            # the loss's backward runs before any gradient of a parameter exists (the head's
            # own follows it), unless the buffers are already live
            loss = (grads_total if accumulating else 0) + live + logits_f + logits_b
            if loss > bwd:
                bwd = loss
        fwd = base + live + logits_f
        g_fwd = grads_total if accumulating else 0
    # streaming: the CPU updates each layer as its gradients land; otherwise ZeRO-3's
    # gathered units are released once backward is done
    optimizer = base if streaming else params + grads_total + master + opt + opt_temp + ema
    return (
        fwd + g_fwd,
        base + bwd,
        fwd + g_fwd + opt,
        base + bwd + opt,
        optimizer,
    )


def _layer_extra(
    own: tuple[int, int, int], temporaries: tuple[int, int, int, int, int]
) -> tuple[int, int, int]:
    """(own gradients, other bytes, total) a layer's backward holds at its peak beyond its
    saved tensors: as it starts (an MoE layer, on its routed experts' outputs: of its
    gradients only its shared experts'), during its MLP's backward
    (the MLP's temporaries and the share of its gradients made by then), or once that is done
    (all of the MLP's gradients, its saved tensors freed, and what an MoE layer's routed
    experts hold as their backward ends), whichever is largest."""
    (share, whole, at_start), (throughout, mlp, freed, start, end) = own, temporaries
    if not start:  # nothing held before the routed experts' backward but what it holds later
        at_start = 0
    if mlp + share >= max(whole - freed + end, start + at_start):
        return share, throughout + mlp, throughout + mlp + share
    if start + at_start > whole - freed + end:
        return at_start, throughout + start, throughout + start + at_start
    return whole, throughout - freed + end, throughout - freed + end + whole


def _layer_totals(
    own_grads: tuple[tuple[int, int, int], tuple[int, int, int]],
    temporaries: tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]],
) -> tuple[int, int]:
    """``_layer_extra``'s totals of a dense and an MoE layer."""
    return (
        _layer_extra(own_grads[0], temporaries[0])[2],
        _layer_extra(own_grads[1], temporaries[1])[2],
    )


def _stage_layer_extras(t: StageTerms) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``_layer_extra`` of a dense and an MoE layer of the stage ``t`` describes."""
    return (
        _layer_extra((t.own_grads_dense, t.mlp_grads_dense, 0), t.layer_temporaries[0]),
        _layer_extra((t.own_grads_moe, t.mlp_grads_moe, t.start_grads_moe), t.layer_temporaries[1]),
    )


def _through_layers(
    points: tuple[tuple[int, int, int, int, int], ...],
    grads_start: int,
    layer_grads: tuple[int, int],
    extra: tuple[int, int],
    others: int,
) -> int:
    """Gradients and transient bytes at the largest of the layers' backward points: per kind
    (dense, MoE), a layer's gradients (``layer_grads``) and what its backward holds beyond its
    saved tensors at its peak (``extra``, from ``_layer_totals``). ``others`` is what the other
    micro-batches in flight keep of their forwards (0 without layers)."""
    best = 0
    g_dense, g_moe = layer_grads
    for dense, moe, held, dispatch, is_moe in points:
        at = grads_start + dense * g_dense + moe * g_moe + extra[is_moe] + others + held
        at += dispatch
        if at > best:
            best = at
    return best


def _peak(
    all_states: tuple[tuple[Any, ...], ...],
    all_acts: tuple[tuple[Any, ...], ...],
    stages: tuple[int, ...],
    grad_accum: int,
    streaming: bool,
    context: int,
    fraction: float,
) -> tuple[int, int, int]:
    """The GPU peak over ``stages`` (allocated + context + allocator overhead): (bytes, index of
    the peak stage in ``stages``, index of the peak phase in PHASES)."""
    pp = stages[-1] + 1
    accumulating = grad_accum > 1
    peak, where, index = -1, 0, 0
    for i, s in enumerate(stages):
        totals = _phase_totals(
            all_states[i], all_acts[i], min(pp - s, grad_accum), streaming, accumulating
        )
        allocated = max(totals)
        total = allocated + context + b.allocator_overhead_bytes(allocated, fraction)
        if total > peak:
            peak, where, index = total, i, totals.index(allocated)
    return peak, where, index


def _phase_rows(t: StageTerms, kn: Knobs) -> tuple[tuple[int, ...], ...]:
    """Allocated bytes per GPU bucket (first nine, DESIGN order) in each phase (PHASES order)."""
    params, grads_total, master, ema = t.params, t.grads_total, t.master_params, t.ema
    opt, transfer = t.optimizer_states, t.transfer_buffers
    m, saved, disp = t.in_flight, t.activations_saved, t.dispatch_saved
    logits_f, logits_b = t.logits_forward, t.logits_backward
    acts_all = m * saved
    disp_all = m * disp
    streaming = kn.offload == "streaming"
    accumulating = kn.grad_accum > 1
    g_fwd = grads_total if accumulating and not streaming else 0
    # streaming: the head's input, held for its gradient (_phase_totals says why)
    head_input = t.acts.layer_input if streaming and logits_f else 0
    fwd_transfer = transfer if accumulating or not streaming else 0

    extra = _stage_layer_extras(t)

    def backward(o: int) -> tuple[int, ...]:
        best = (params, t.grads_tail, master, o, ema, 0, 0, 0, transfer)
        for dense, moe, held, dispatch, is_moe in t.backward_points:
            own, temporary, _ = extra[is_moe]
            row = (
                params,
                t.grads_start + dense * t.layer_grads_dense + moe * t.layer_grads_moe + own,
                master,
                o,
                ema,
                acts_all - saved + held + temporary,
                0,
                disp_all - disp + dispatch,
                transfer,
            )
            if sum(row) > sum(best):
                best = row
        if logits_f:
            loss = (
                params,
                grads_total if accumulating and not streaming else 0,
                master,
                o,
                ema,
                acts_all + head_input,
                logits_f + logits_b,
                disp_all,
                0 if streaming else transfer,
            )
            if sum(loss) > sum(best):
                best = loss
        return best

    if streaming:  # the CPU updates each layer as its gradients land
        optimizer = (params, 0, master, 0, ema, 0, 0, 0, transfer)
    else:  # ZeRO-3's gathered units are released once backward is done
        optimizer = (params, grads_total, master, opt + t.optimizer_temporaries, ema, 0, 0, 0, 0)
    return (
        (
            params,
            g_fwd,
            master,
            0,
            ema,
            acts_all + head_input,
            logits_f,
            disp_all,
            fwd_transfer,
        ),
        backward(0),
        (
            params,
            g_fwd,
            master,
            opt,
            ema,
            acts_all + head_input,
            logits_f,
            disp_all,
            fwd_transfer,
        ),
        backward(opt),
        optimizer,
    )


def _overheads(coeffs: Coefficients, hw: Hardware, expandable_segments: bool) -> tuple[int, float]:
    context = coeffs.cuda_context_bytes
    if context is None:
        context = hw.cuda_context_bytes
    if expandable_segments:
        fraction = coeffs.expandable_segments_overhead_fraction
    elif coeffs.allocator_overhead_fraction is not None:
        fraction = coeffs.allocator_overhead_fraction
    else:
        fraction = hw.allocator_overhead_fraction
    return context, fraction


def stage_terms(
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    stage: int,
    coefficients: Coefficients | None = None,
) -> tuple[StageTerms, Coefficients]:
    """One stage's terms (``explain`` asks for the estimate's heaviest) and the coefficients."""
    coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
    return _stage_terms(model, knobs(train), coeffs, stage), coeffs


def estimate(
    model: ModelSpec, train: TrainSpec, hardware: Hardware, coefficients: Coefficients | None = None
) -> Budget:
    """Predict per-bucket GPU and host bytes on the heaviest rank, the peak and its phase."""
    return evaluate(model, knobs(train), hardware, coefficients)


def evaluate(
    model: ModelSpec, kn: Knobs, hardware: Hardware, coefficients: Coefficients | None = None
) -> Budget:
    """``estimate`` on flattened knobs: what a search calls with ``knobs(train)._replace(...)``.

    Knobs made by ``_replace`` skip ``TrainSpec`` validation: the caller keeps them in range.
    """
    coeffs = coefficients or default_coefficients(kn.activation_profile, hardware.name)
    context, fraction = _overheads(coeffs, hardware, kn.expandable_segments)
    pp = kn.pp
    stages = (0, pp - 1) if pp > 1 else (0,)
    all_states, all_acts = _stage_parts(model, kn, coeffs, stages)
    peak, i, index = _peak(
        all_states, all_acts, stages, kn.grad_accum, kn.offload == "streaming", context, fraction
    )
    stage, host = stages[i], all_states[i][-1]
    capacity = hardware.memory_bytes
    ranks = min(hardware.gpus_per_node, kn.dp * kn.tp * pp * kn.cp)
    host_peak = sum(host) * ranks
    host_cap = hardware.host_memory_bytes
    margin = math.ceil(peak * coeffs.margin_fraction)
    fits = peak + margin <= capacity and (host_cap is None or host_peak <= host_cap)
    warnings = []
    if kn.offload == "streaming" and kn.ema == "gpu":
        warnings.append("ema: streaming keeps the EMA in host RAM; 'gpu' was treated as 'host'")
    if host_cap is None and host_peak:
        warnings.append("host: no --host-memory given; host RAM was not checked")
    return Budget(
        PHASES[index],
        fits,
        stage,
        margin,
        warnings,
        peak,
        host_peak,
        model,
        hardware.name,
        capacity,
        lambda: _phase_rows(_stage_terms(model, kn, coeffs, stage), kn),
        context,
        fraction,
        host,
        ranks,
        host_cap,
        coeffs,
    )


def layer_backward_bytes(
    model: ModelSpec, train: TrainSpec, coefficients: Coefficients | None = None
) -> int:
    """Allocated bytes of the first stage at the largest of its backward points in the steady
    state: the peak while one of its layers' backward runs (calibration compares it with the
    largest a trace saw inside a decoder layer's backward)."""
    kn = knobs(train)
    t = _stage_terms(model, kn, coefficients or default_coefficients(kn.activation_profile), 0)
    others = (t.in_flight - 1) * (t.activations_saved + t.dispatch_saved)
    dense, moe = _stage_layer_extras(t)
    through = _through_layers(
        t.backward_points,
        t.grads_start,
        (t.layer_grads_dense, t.layer_grads_moe),
        (dense[2], moe[2]),
        others,
    )
    return t.params + t.master_params + t.ema + t.transfer_buffers + t.optimizer_states + through


def clear_spec_caches() -> None:
    """Forget every memoised spec-dependent term (model-derived facts stay cached)."""
    _STATES.clear()
    _ACTS.clear()
    knobs.cache_clear()  # type: ignore[attr-defined]
    layer_activations.cache_clear()  # type: ignore[attr-defined]
