"""The estimator: per-bucket bytes on the heaviest rank, phase by phase, and the verdict.

A step has phases. Step 1 runs forward and backward before any optimizer state exists; from
step 2 on the moments are resident throughout. Within backward, activations are freed layer by
layer while gradients appear, so the backward peak is taken at its start (all activations, the
loss temporaries or the first recomputed block) and at its end (almost all gradients, the last
block). The optimizer phase adds the step's own temporaries. The reported peak is the largest
phase total, never the sum of the buckets' separate maxima.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from planner import buckets as b
from planner.activations import LayerActivations, layer_activations
from planner.budget import (
    GPU_BUCKETS,
    HOST_BUCKETS,
    Budget,
    CoefficientsUsed,
    GpuBudget,
    HostBudget,
    ModelSummary,
    PhaseBudget,
    construct,
)
from planner.coefficients import Coefficients, default_coefficients
from planner.errors import SpecError
from planner.hardware import Hardware
from planner.model import ModelSpec
from planner.params import count_params
from planner.stage import StageParams, offloaded_numel, stage_params
from planner.train import BYTES_PER_ELEMENT, TrainSpec

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
    grads_start: int
    grads_end: int
    master_params: int
    optimizer_states: int
    optimizer_temporaries: int
    ema: int
    transfer_buffers: int
    activations_saved: int  # per micro-batch, at the end of forward
    dispatch_saved: int  # per micro-batch
    recompute_block: int  # transient in backward (activations)
    recompute_dispatch: int  # transient in backward (moe_dispatch)
    first_layer_saved: int
    first_layer_dispatch: int
    logits_forward: int
    logits_backward: int
    host: tuple[int, int, int, int, int, int]  # HOST_BUCKETS order, per rank


def _check(train: TrainSpec) -> None:
    p = train.parallel
    if train.offload.mode == "streaming" and (p.tp > 1 or p.pp > 1):
        raise SpecError(
            "offload.mode: streaming runs one layer stream per GPU; it needs parallel.tp=1 and "
            f"parallel.pp=1, got tp={p.tp} pp={p.pp}",
            field="offload.mode",
        )


def _stage_terms(
    model: ModelSpec, train: TrainSpec, coeffs: Coefficients, stage: int
) -> StageTerms:
    p = train.parallel
    prec = train.precision
    bp = BYTES_PER_ELEMENT[prec.params]
    bg = BYTES_PER_ELEMENT[prec.grads]
    if bg > bp:
        # fp32 accumulation: autograd still produces working-precision grads, accumulated
        # into an fp32 buffer (the seeds' 20 B/param case)
        bg += bp
    bm = BYTES_PER_ELEMENT[prec.master]
    bo = BYTES_PER_ELEMENT[prec.optimizer_states]
    sp = stage_params(model, p.tp, p.pp, p.ep, stage)
    moe = model.moe
    cf = train.moe_capacity_factor or (moe.capacity_factor if moe else None)
    acts = layer_activations(
        model,
        train.micro_batch_size,
        train.seq_len,
        bp,
        train.attention == "eager",
        p.tp,
        p.cp,
        p.ep,
        p.sequence_parallel,
        cf or _DEFAULT_CAPACITY_FACTOR,
        train.moe_imbalance,
        coeffs,
    )
    streaming = train.offload.mode == "streaming"
    dp = p.dp * p.cp
    edp = dp // p.ep
    z = p.zero_stage
    zd = (dp if z >= 3 else 1, dp if z >= 2 else 1, dp if z >= 1 else 1)
    ze = (edp if z >= 3 else 1, edp if z >= 2 else 1, edp if z >= 1 else 1)
    if streaming:  # host holds every persistent byte; ZeRO has nothing to shard on the GPU
        zd = ze = (1, 1, 1)
    dense, expert = sp.dense_numel, sp.expert_numel

    # Model states, local shard, before placement: dense tensors shard over dp x cp, experts
    # over the expert-data-parallel group.
    def states(numel: int, matrix: int, adafactor: int, adam8bit: int, shards: int) -> int:
        return b.optimizer_state_bytes(
            train.optimizer,
            numel,
            bo,
            matrix_numel=matrix,
            adafactor_numel=adafactor,
            adam8bit_bytes=adam8bit,
            zero1_shards=shards,
        )

    opt_total = states(
        dense, sp.matrix_dense_numel, sp.adafactor_dense_numel, sp.adam8bit_dense_bytes, zd[2]
    ) + states(
        expert,
        sp.matrix_expert_numel,
        sp.adafactor_expert_numel,
        sp.adam8bit_expert_bytes,
        ze[2],
    )
    local_opt_numel = -(-dense // zd[2]) + -(-expert // ze[2])
    master_total = b.master_params_bytes(dense, bm, zd[2]) + b.master_params_bytes(
        expert, bm, ze[2]
    )
    ema_total = b.ema_bytes(dense, zd[2]) + b.ema_bytes(expert, ze[2]) if train.ema != "none" else 0
    upcast = 4 if (bm == 4 and bg < 4) else 0

    if streaming:
        unit = sp.max_unit_numel
        params = train.offload.num_buffers * unit * bp
        grads_total = grads_start = grads_end = unit * bg
        transfer = 2 * unit * bg  # gradient slabs draining to the host
        master = opt = opt_temp = ema_gpu = 0
        off = local_opt_numel
        gpu_updated = 0
        numel = dense + expert
        host = (numel * bp, numel * 4, master_total, opt_total, ema_total, 2 * unit * bg)
    else:
        params = b.params_bytes(dense, bp, zd[0]) + b.params_bytes(expert, bp, ze[0])
        grads_total = b.grads_bytes(dense, bg, zd[1]) + b.grads_bytes(expert, bg, ze[1])
        if train.offload.mode == "optimizer":
            off_d, off_e = offloaded_numel(sp, zd[2], ze[2], train.offload.fraction)
        else:
            off_d = off_e = 0
        off = off_d + off_e
        gpu_updated = local_opt_numel - off
        share = gpu_updated / local_opt_numel if local_opt_numel else 0.0
        opt = int(opt_total * share)
        master = gpu_updated * bm
        opt_temp = (
            b.optimizer_temporary_bytes(
                train.optimizer,
                train.optimizer_impl,
                gpu_updated,
                sp.largest_tensor_numel,
                sp.largest_matrix_numel,
                bo,
                upcast,
            )
            if gpu_updated
            else 0
        )
        ema_gpu = ema_total if train.ema == "gpu" else 0
        ema_host = ema_total if train.ema == "host" else 0
        # ZeRO-3 gathers full layers around compute: the layer in use and the one prefetched.
        transfer = 2 * (sp.max_unit_numel * bp) if (z >= 3 and dp > 1) else 0
        head_grads = b.grads_bytes(sp.head_unit_numel, bg, zd[1]) if sp.has_head else 0
        embed_grads = b.grads_bytes(sp.embedding_numel, bg, zd[1]) if sp.has_embedding else 0
        grads_start = grads_total if train.grad_accum_steps > 1 else head_grads
        grads_end = grads_total - embed_grads
        host = (0, off * 4, off * bm, opt_total - opt, ema_host, 0)

    # Activations.
    n, n_moe = sp.num_layers, sp.num_moe_layers
    n_dense = n - n_moe
    k = train.checkpoint_every
    if train.recompute == "full" and k is None:
        k = 1
    first_act = acts.moe if sp.first_layer_is_moe else acts.dense
    first_disp = acts.dispatch if sp.first_layer_is_moe else 0
    if k is None:
        saved = n_dense * acts.dense + n_moe * acts.moe
        disp = n_moe * acts.dispatch
        block = block_disp = 0
        if train.recompute == "selective":
            saved -= n * acts.scores
            first_act -= acts.scores
            block = acts.scores if n else 0
    else:
        blk = min(k, n)
        saved = math.ceil(n / k) * acts.layer_input if n else 0
        disp = 0

        def block_bytes(num_moe: int) -> int:
            # the block's checkpoint is its first norm's saved input: count it once
            return max(0, num_moe * acts.moe + (blk - num_moe) * acts.dense - acts.layer_input)

        last_moe = sum(sp.moe_flags[n - blk :]) if n else 0
        first_moe = sum(sp.moe_flags[:blk])
        block, block_disp = block_bytes(last_moe), last_moe * acts.dispatch
        # backward ends recomputing the stage's first block
        first_act = (acts.layer_input + block_bytes(first_moe) - block) if n else 0
        first_disp = (first_moe - last_moe) * acts.dispatch
    in_flight = min(p.pp - stage, train.grad_accum_steps)

    logits_f = logits_b = 0
    if sp.has_head:
        tokens = train.micro_batch_size * -(-train.seq_len // p.cp)
        vocab_local = -(-model.vocab_size // p.tp)
        logits_f = b.logits_bytes(tokens, vocab_local, coeffs.logits_bytes_per_element)
        logits_b = b.logits_bytes(tokens, vocab_local, coeffs.logits_backward_bytes_per_element)

    return StageTerms(
        sp=sp,
        acts=acts,
        in_flight=in_flight,
        checkpoint_every=k,
        zero_dense=zd,
        zero_expert=ze,
        offloaded_numel=off,
        gpu_updated_numel=gpu_updated,
        params=params,
        grads_total=grads_total,
        grads_start=grads_start,
        grads_end=grads_end,
        master_params=master,
        optimizer_states=opt,
        optimizer_temporaries=opt_temp,
        ema=ema_gpu,
        transfer_buffers=transfer,
        activations_saved=saved,
        dispatch_saved=disp,
        recompute_block=block,
        recompute_dispatch=block_disp,
        first_layer_saved=first_act,
        first_layer_dispatch=first_disp,
        logits_forward=logits_f,
        logits_backward=logits_b,
        host=host,
    )


def _phase_buckets(t: StageTerms, train: TrainSpec) -> dict[str, tuple[int, ...]]:
    """Allocated bytes per GPU bucket (first nine, DESIGN order) in each phase."""
    m = t.in_flight
    acts_all = m * t.activations_saved
    disp_all = m * t.dispatch_saved
    g_fwd = (
        t.grads_total if (train.grad_accum_steps > 1 or train.offload.mode == "streaming") else 0
    )
    base = (t.params, t.master_params, t.ema, t.transfer_buffers)

    def row(grads: int, opt: int, acts: int, logits: int, disp: int) -> tuple[int, ...]:
        return (base[0], grads, base[1], opt, base[2], acts, logits, disp, base[3])

    def backward(opt: int) -> tuple[int, ...]:
        points = [
            row(
                t.grads_start, opt, acts_all + t.recompute_block, 0, disp_all + t.recompute_dispatch
            ),
            row(
                t.grads_end,
                opt,
                (m - 1) * t.activations_saved + t.first_layer_saved + t.recompute_block,
                0,
                (m - 1) * t.dispatch_saved + t.first_layer_dispatch + t.recompute_dispatch,
            ),
        ]
        if t.logits_forward:
            points.append(
                row(t.grads_start, opt, acts_all, t.logits_forward + t.logits_backward, disp_all)
            )
        return max(points, key=sum)

    opt = t.optimizer_states
    if train.offload.mode == "streaming":
        optimizer = row(0, 0, 0, 0, 0)  # the CPU updates each layer as its gradients land
    else:
        # ZeRO-3's gathered units are released once backward is done
        optimizer = (*row(t.grads_total, opt + t.optimizer_temporaries, 0, 0, 0)[:8], 0)
    return {
        "step1_forward": row(
            g_fwd if train.grad_accum_steps > 1 else 0, 0, acts_all, t.logits_forward, disp_all
        ),
        "step1_backward": backward(0),
        "forward": row(g_fwd, opt, acts_all, t.logits_forward, disp_all),
        "backward": backward(opt),
        "optimizer": optimizer,
    }


def _overheads(coeffs: Coefficients, hw: Hardware, train: TrainSpec) -> tuple[int, float]:
    context = coeffs.cuda_context_bytes
    if context is None:
        context = hw.cuda_context_bytes
    if train.expandable_segments:
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
    return _stage_terms(model, train, coeffs, stage), coeffs


def estimate(
    model: ModelSpec, train: TrainSpec, hardware: Hardware, coefficients: Coefficients | None = None
) -> Budget:
    """Predict per-bucket GPU and host bytes on the heaviest rank, the peak and its phase."""
    _check(train)
    coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
    context, fraction = _overheads(coeffs, hardware, train)
    pp = train.parallel.pp
    best: tuple[int, int, str, tuple[int, ...], dict[str, tuple[int, ...]], StageTerms] | None
    best = None
    for stage in (0, pp - 1) if pp > 1 else (0,):
        terms = _stage_terms(model, train, coeffs, stage)
        phases = _phase_buckets(terms, train)
        peak_phase, peak_row = max(phases.items(), key=lambda kv: sum(kv[1]))
        allocated = sum(peak_row)
        total = allocated + context + b.allocator_overhead_bytes(allocated, fraction)
        if best is None or total > best[0]:
            best = (total, stage, peak_phase, peak_row, phases, terms)
    assert best is not None
    peak, stage, peak_phase, peak_row, phases, terms = best

    def full(row: tuple[int, ...]) -> dict[str, int]:
        allocated = sum(row)
        out = dict(zip(GPU_BUCKETS[:9], row, strict=True))
        out["cuda_context"] = context
        out["allocator_overhead"] = b.allocator_overhead_bytes(allocated, fraction)
        return out

    phase_out = {}
    for name, row in phases.items():
        buckets = full(row)
        phase_out[name] = construct(PhaseBudget, total_bytes=sum(buckets.values()), buckets=buckets)
    capacity = hardware.memory_bytes
    ranks = min(hardware.gpus_per_node, train.parallel.world_size)
    host_buckets = {name: v * ranks for name, v in zip(HOST_BUCKETS, terms.host, strict=True)}
    host_peak = sum(host_buckets.values())
    host_cap = hardware.host_memory_bytes
    margin = math.ceil(peak * coeffs.margin_fraction)
    fits = peak + margin <= capacity and (host_cap is None or host_peak <= host_cap)
    counts = count_params(model)
    warnings = []
    if train.offload.mode == "streaming" and train.ema == "gpu":
        warnings.append("ema: streaming keeps the EMA in host RAM; 'gpu' was treated as 'host'")
    if host_cap is None and host_peak:
        warnings.append("host: no --host-memory given; host RAM was not checked")
    return construct(
        Budget,
        model=construct(
            ModelSummary,
            name=model.name,
            params_total=counts.total,
            params_active_per_token=counts.per_token_active,
            params_mtp_excluded=counts.mtp_excluded,
        ),
        gpu=construct(
            GpuBudget,
            name=hardware.name,
            capacity_bytes=capacity,
            peak_bytes=peak,
            headroom_bytes=capacity - peak,
            buckets=phase_out[peak_phase].buckets,
            phases=phase_out,
        ),
        host=construct(
            HostBudget,
            capacity_bytes=host_cap,
            peak_bytes=host_peak,
            headroom_bytes=None if host_cap is None else host_cap - host_peak,
            ranks_sharing=ranks,
            buckets=host_buckets,
        ),
        peak_phase=peak_phase,
        fits=fits,
        stage=stage,
        margin_bytes=margin,
        coefficients=construct(
            CoefficientsUsed,
            profile=coeffs.profile,
            device=coeffs.device,
            calibrated=coeffs.calibrated,
            source=coeffs.source,
            margin_fraction=coeffs.margin_fraction,
        ),
        warnings=warnings,
    )
