"""The estimator: per-bucket bytes on the heaviest rank, phase by phase, and the verdict.

A training spec is flattened once into ``Knobs``. Each pipeline stage that can be the heaviest
(the first and the last) gets two named halves of terms: its persistent ``ModelStates``
(``planner.states``: placement, precisions, optimizer, offload) and its ``ActivationTerms``
(``planner.activations``: batch shape, recompute). Each half is memoised by its own inputs
(``StatesInputs``, ``ActivationInputs``), so a search that varies the batch shape reuses the
states and one that varies placement reuses the activations. ``planner.phases`` turns a
stage's terms into allocated bytes per bucket and phase; the reported peak is the largest phase
total (plus the CUDA context and the allocator's overhead), never the sum of the buckets'
separate maxima.

The verdict does not build the activation terms: ``end_stages`` adds each end stage's phase
totals up (``planner.phases.stages_largest``) from its persistent state's sums (memoised with
the state) and the layers' terms under the batch shape (``planner.activations.layer_shape``,
memoised by the inputs besides the recompute); the Budget's views, ``explain`` and the ladder
read the named terms (``stage_parts``). ``estimate`` memoises the end stages' largest phases
per knobs object (``end_stages``; a search's ``evaluate`` does not): a spec estimated again
costs the verdict alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

from headroom.planner import buckets as b
from headroom.planner._memo import SMALL_ENTRY_BYTES, BoundedDict, identity_memo
from headroom.planner.activations import (
    ActivationInputs,
    ActivationTerms,
    clear_layer_shapes,
    stages_activation_terms,
    terms_bytes,
)
from headroom.planner.budget import PHASES, Budget
from headroom.planner.coefficients import (
    Coefficients,
    coefficients_bytes,
    default_coefficients,
    profiles,
)
from headroom.planner.errors import SpecError
from headroom.planner.hardware import Hardware
from headroom.planner.losses import WHOLE_VOCAB_IMPLS
from headroom.planner.model import ModelSpec, spec_bytes
from headroom.planner.phases import (
    CONSTANTS_BYTES,
    PhaseRows,
    StageAllocated,
    StageConstants,
    largest_phase,
    phase_rows,
    stage_constants,
    stage_layer_backward,
    stages_largest,
)
from headroom.planner.schedules import V_SHAPED, check_schedule, in_flight
from headroom.planner.stage import StageParams
from headroom.planner.states import (
    HostBytes,
    ModelStates,
    StatesInputs,
    model_states,
    states_bytes,
)
from headroom.planner.train import BYTES_PER_ELEMENT, TrainSpec
from headroom.planner.untraced import untraced_warnings

#: builds a named tuple from a tuple of its fields without calling its ``__new__`` (a Python
#: call): what a search builds per candidate
_new = tuple.__new__


class Knobs(NamedTuple):
    """A training spec flattened to the scalars the estimate reads, resolved once per spec.

    A search (the auto-fit ladder) varies these directly with ``_replace`` instead of validating
    a new ``TrainSpec`` per candidate; ``knobs(train)`` is the only way to make one from a spec.
    """

    micro_batch: int
    seq_len: int
    grad_accum: int
    param_bytes: int  # bytes per working parameter (and per activation element)
    grad_bytes: int  # bytes per gradient, plus the working-precision one when accumulating
    # in fp32
    master_bytes: int  # bytes per master parameter (0: none)
    state_bytes: int  # bytes per optimizer-state element
    optimizer: str
    optimizer_impl: str
    eager_attention: bool
    ema: str
    dp: int
    tp: int
    pp: int
    ep: int
    cp: int
    sequence_parallel: bool
    zero_stage: int
    offload_mode: str  # none | optimizer | streaming
    offload_fraction: float  # share of the optimizer offloaded (read with mode optimizer)
    num_buffers: int  # streaming's layer buffers
    selective: bool  # selective recompute
    checkpoint_every: int | None  # layers per recomputed block (full recompute: 1)
    capacity_factor: float | None
    imbalance: float
    expandable_segments: bool
    activation_profile: str
    clips_grad_norm: bool  # global-norm clipping: streaming's CPU update waits for the norm
    framework: str = "none"  # none | fsdp2
    reshard_after_forward: bool = True  # fsdp2's
    fsdp2_groups: str = "root"  # fsdp2's grouping of the embedding, final norm and head
    reduce_bytes: int = 4  # bytes per element of a reduction's input (precision.grads)
    deepspeed: tuple[int, ...] = ()  # DeepSpeed's knobs (``deepspeed_knobs``)
    distributed_optimizer: bool = True  # megatron's use_distributed_optimizer
    vpp: int = 1  # virtual pipeline stages per rank (1: 1F1B; more: interleaved 1F1B)
    pp_schedule: str | None = None  # the schedule the spec names (``planner.schedules``)
    selective_op: bool = False  # torchtitan's per-op selective checkpointing (every layer a
    # block re-run in its backward; ``checkpoint_every`` stays None: no block checkpoints)
    loss_impl: str = "standard"  # the loss's implementation (``planner.losses``)
    loss_chunks: int = 0  # chunks it splits the tokens into (0: none by count)
    optimizer_in_backward: bool = False  # each parameter stepped as its gradient lands
    compiled_layers: bool = False  # the decoder layers run under torch.compile


#: a training spec and its knobs (its one free text, the profile, is at most 64 characters)
_TRAIN_ENTRY_BYTES = 8192


@identity_memo(4096, 4 << 20, nbytes=lambda train: _TRAIN_ENTRY_BYTES)
def knobs(train: TrainSpec) -> Knobs:
    """The scalars of ``train`` the estimate reads (memoised per spec object)."""
    parallel, precision, offload = train.parallel, train.precision, train.offload
    _check(train)
    param_bytes = BYTES_PER_ELEMENT[precision.params]
    grad_bytes = BYTES_PER_ELEMENT[precision.grads]
    if grad_bytes > param_bytes:
        # fp32 accumulation: autograd still produces working-precision grads, accumulated
        # into an fp32 buffer (ZeRO's 20 B/param case, arXiv:1910.02054)
        grad_bytes += param_bytes
    checkpoint_every = train.checkpoint_every
    if train.recompute == "full" and checkpoint_every is None:
        checkpoint_every = 1
    return Knobs(
        micro_batch=train.micro_batch_size,
        seq_len=train.seq_len,
        grad_accum=train.grad_accum_steps,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        master_bytes=BYTES_PER_ELEMENT[precision.master],
        state_bytes=BYTES_PER_ELEMENT[precision.optimizer_states],
        optimizer=train.optimizer,
        optimizer_impl=train.optimizer_impl,
        eager_attention=train.attention == "eager",
        ema=train.ema,
        dp=parallel.dp,
        tp=parallel.tp,
        pp=parallel.pp,
        ep=parallel.ep,
        cp=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        zero_stage=parallel.zero_stage,
        offload_mode=offload.mode,
        offload_fraction=offload.fraction,
        num_buffers=offload.num_buffers,
        selective=train.recompute == "selective",
        checkpoint_every=checkpoint_every,
        capacity_factor=train.moe_capacity_factor,
        imbalance=train.moe_imbalance,
        expandable_segments=train.expandable_segments,
        activation_profile=train.activation_profile,
        clips_grad_norm=train.max_grad_norm is not None,
        framework=train.framework,
        reshard_after_forward=train.fsdp2.reshard_after_forward,
        fsdp2_groups=train.fsdp2.groups,
        reduce_bytes=BYTES_PER_ELEMENT[precision.grads],
        deepspeed=deepspeed_knobs(train) if train.framework == "deepspeed" else (),
        distributed_optimizer=train.megatron.use_distributed_optimizer,
        vpp=parallel.vpp,
        pp_schedule=parallel.pp_schedule,
        selective_op=train.recompute == "selective_op",
        loss_impl=train.loss.priced_impl,
        loss_chunks=train.loss.num_chunks,
        optimizer_in_backward=train.optimizer_in_backward,
        compiled_layers=train.compile,
    )


def deepspeed_knobs(train: TrainSpec) -> tuple[int, ...]:
    """DeepSpeed's knobs as ``planner.states.deepspeed_states`` reads them: reduction bucket
    elements, reduction buckets (2 with overlap_comm), prefetch bucket, live parameters and the
    persistence threshold and the optimizer's sub-group (elements)."""
    ds = train.deepspeed
    overlap = ds.overlap_comm if ds.overlap_comm is not None else train.parallel.zero_stage == 3
    return (
        ds.reduce_bucket_size,
        2 if overlap else 1,
        ds.stage3_prefetch_bucket_size,
        ds.stage3_max_live_parameters,
        ds.stage3_param_persistence_threshold,
        ds.sub_group_size,
    )


class FrameworkRules(NamedTuple):
    """What a framework runs: its ZeRO stages and offload modes, and why."""

    zero_stages: tuple[int, ...]
    zero_why: str
    offload_modes: tuple[str, ...]
    offload_why: str


#: each framework's rules (``none`` runs every stage and placement)
FRAMEWORK_RULES = {
    "fsdp2": FrameworkRules(
        (3,),
        "framework fsdp2 shards parameters, gradients and optimizer state (ZeRO stage 3)",
        ("none",),
        "framework fsdp2 keeps its state on the GPU",
    ),
    "deepspeed": FrameworkRules(
        (1, 2, 3),
        "framework deepspeed is DeepSpeed ZeRO (framework none is plain data parallelism)",
        ("none", "optimizer"),
        "DeepSpeed offloads the optimizer (offload_optimizer)",
    ),
    "megatron": FrameworkRules(
        (0,),
        "framework megatron shards the optimizer with megatron.use_distributed_optimizer",
        ("none", "optimizer"),
        "Megatron offloads the optimizer (optimizer_cpu_offload)",
    ),
}


def _check(train: TrainSpec) -> None:
    p = train.parallel
    check_schedule(p.pp_schedule, train.framework, p.vpp, p.pp)
    rules = FRAMEWORK_RULES.get(train.framework)
    if rules is not None:
        if p.zero_stage not in rules.zero_stages:
            allowed = ", ".join(map(str, rules.zero_stages))
            raise SpecError(
                f"parallel.zero_stage: {rules.zero_why}; allowed: {allowed}, got {p.zero_stage}",
                field="parallel.zero_stage",
            )
        if train.offload.mode not in rules.offload_modes:
            allowed = ", ".join(rules.offload_modes)
            raise SpecError(
                f"offload.mode: {rules.offload_why}; allowed: {allowed}, got {train.offload.mode}",
                field="offload.mode",
            )
    if train.offload.mode == "streaming" and (p.tp > 1 or p.pp > 1):
        raise SpecError(
            "offload.mode: streaming runs one layer stream per GPU; it needs parallel.tp=1 and "
            f"parallel.pp=1, got tp={p.tp} pp={p.pp}",
            field="offload.mode",
        )
    if train.recompute == "selective_op" and train.offload.mode == "streaming":
        raise SpecError(
            "recompute: offload.mode streaming checkpoints its own blocks "
            "(offload.checkpoint_every); selective_op is torchtitan's policy, not the "
            "bundled trainer's; allowed with streaming: none, full or every_k",
            field="recompute",
        )
    if train.recompute == "selective_op" and p.cp > 1:
        raise SpecError(
            "recompute: selective_op is priced for parallel.cp 1 (under context parallelism "
            "the policy keeps each ring step's attention outputs, which is not modelled); "
            f"got cp={p.cp}",
            field="recompute",
        )
    _check_loss(train)
    if train.optimizer_in_backward:
        _check_optimizer_in_backward(train)
    if p.sequence_parallel and train.seq_len % p.tp:
        # sequence parallelism splits each sequence across the TP ranks
        raise SpecError(
            f"train.seq_len: parallel.sequence_parallel needs a multiple of parallel.tp "
            f"({p.tp}), got {train.seq_len}",
            field="train.seq_len",
        )


def _check_optimizer_in_backward(train: TrainSpec) -> None:
    """Refuse ``optimizer_in_backward`` where torchtune's recipe refuses it, or where it is not
    priced: it is priced on one device, as torchtune's single-device recipe runs it."""
    p = train.parallel
    degrees = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep}
    spread = {k: v for k, v in degrees.items() if v > 1}
    if train.framework != "none" or spread or train.offload.mode != "none":
        got = ", ".join(f"parallel.{k}={v}" for k, v in spread.items()) or (
            f"framework {train.framework}, offload.mode {train.offload.mode}"
        )
        raise SpecError(
            "optimizer_in_backward: priced on one device (framework none, every parallel "
            f"degree 1, offload.mode none), as torchtune's single-device recipe runs it; got {got}",
            field="optimizer_in_backward",
        )
    if train.grad_accum_steps > 1:
        raise SpecError(
            "optimizer_in_backward: each parameter is stepped as its gradient lands, so "
            "gradients cannot accumulate (torchtune: 'Requires gradient_accumulation_steps=1'); "
            f"allowed grad_accum_steps: 1, got {train.grad_accum_steps}",
            field="grad_accum_steps",
        )
    if train.max_grad_norm is not None:
        raise SpecError(
            "optimizer_in_backward: each parameter is stepped before the others' gradients "
            "exist, so there is no global norm to clip by; set max_grad_norm null "
            f"(got {train.max_grad_norm})",
            field="max_grad_norm",
        )


def _check_loss(train: TrainSpec) -> None:
    """Refuse a loss implementation where its code does not run as derived
    (``planner.losses``), naming the field."""
    loss, p = train.loss, train.parallel
    if loss.compiled and p.tp > 1:
        raise SpecError(
            "loss.compiled: the compiled cross entropy is priced on a whole vocabulary (a "
            f"loss-parallel one is not modelled); allowed with parallel.tp {p.tp}: false",
            field="loss.compiled",
        )
    if loss.impl in WHOLE_VOCAB_IMPLS and p.tp > 1:
        raise SpecError(
            f"loss.impl: {loss.impl} is priced on a whole vocabulary (its code is not "
            "vocab-parallel, or under tensor parallelism runs a loss-parallel cross entropy "
            f"that is not modelled); allowed with parallel.tp {p.tp}: standard, fused",
            field="loss.impl",
        )
    if loss.impl == "fused" and train.precision.params != "bf16":
        raise SpecError(
            "loss.impl: Megatron's fused cross entropy casts its gradient to bf16; it is "
            f"priced for precision.params bf16, got {train.precision.params}",
            field="loss.impl",
        )
    if loss.impl == "cut" and train.precision.params == "fp32":
        raise SpecError(
            "loss.impl: Cut Cross-Entropy's backward takes 16-bit inputs only; allowed "
            "precision.params: bf16, fp16, got fp32",
            field="loss.impl",
        )
    seq_local = -(-train.seq_len // p.cp)
    if loss.impl == "chunked_linear" and seq_local % loss.num_chunks:
        raise SpecError(
            f"loss.chunks: torchtitan's ChunkedLossWrapper needs the rank's sequence "
            f"({seq_local} tokens) to divide into its chunks, got {loss.num_chunks}",
            field="loss.chunks",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTerms:
    """Every term of one stage's estimate (``explain`` and the Budget's views read these)."""

    states: ModelStates
    """Its persistent state."""
    activations: ActivationTerms
    """One micro-batch's activation terms."""
    in_flight: int
    """Micro-batches whose activations are alive at once (pipeline warm-up)."""
    checkpoint_every: int | None
    """Layers per recomputed block (None: no block recompute)."""
    streaming: bool
    """Layers stream through the GPU (offload mode streaming)."""
    accumulating: bool
    """Gradients accumulate over more than one micro-batch."""

    @property
    def stage_params(self) -> StageParams:
        """The stage's local parameter facts."""
        return self.states.stage_params

    def rows(self) -> PhaseRows:
        """Allocated bytes per GPU bucket in each phase (what the Budget shows)."""
        return phase_rows(
            self.states, self.activations, self.in_flight, self.streaming, self.accumulating
        )


class Overheads(NamedTuple):
    """What the allocator and the CUDA runtime add to the allocated bytes."""

    cuda_context_bytes: int
    allocator_overhead_fraction: float  # of the allocated bytes


def overheads(coeffs: Coefficients, hw: Hardware, expandable_segments: bool) -> Overheads:
    """The CUDA context and allocator overhead: the coefficients', else the GPU preset's."""
    context = coeffs.cuda_context_bytes
    if context is None:
        context = hw.cuda_context_bytes
    if expandable_segments:
        fraction = coeffs.expandable_segments_overhead_fraction
    elif coeffs.allocator_overhead_fraction is not None:
        fraction = coeffs.allocator_overhead_fraction
    else:
        fraction = hw.allocator_overhead_fraction
    return _new(Overheads, (context, fraction))


def states_inputs(settings: Knobs, coeffs: Coefficients) -> StatesInputs:
    """The knobs and coefficients ``model_states`` reads (values it ignores normalised, so
    candidates that differ only there share an entry)."""
    mode, framework = settings.offload_mode, settings.framework
    # built by position (``StatesInputs``' fields in declaration order) with ``tuple.__new__``:
    # every new candidate builds one, and the named tuple's own ``__new__`` is a Python call
    fields = (
        settings.tp,
        settings.pp,
        settings.ep,
        settings.dp * settings.cp,  # data_parallel
        settings.zero_stage,
        settings.param_bytes,
        settings.grad_bytes,
        settings.master_bytes,
        settings.state_bytes,
        settings.optimizer,
        settings.optimizer_impl,
        settings.ema,
        mode,
        settings.offload_fraction if mode == "optimizer" else 0.0,
        settings.num_buffers if mode == "streaming" else 0,
        settings.grad_accum > 1,  # accumulating
        coeffs.backward_mlp_grads,
        framework,
        settings.reshard_after_forward,
        settings.fsdp2_groups,
        settings.reduce_bytes if framework in ("fsdp2", "megatron") else 4,
        settings.deepspeed,
        settings.distributed_optimizer if framework == "megatron" else True,
        # embedding_grad_whole_vocab: read by fsdp2 with tp > 1 only
        coeffs.embedding_grad_whole_vocab if framework == "fsdp2" and settings.tp > 1 else True,
        settings.optimizer_in_backward,
        settings.pp_schedule in V_SHAPED,  # v_shaped
    )
    return _new(StatesInputs, fields)


def activation_inputs(settings: Knobs) -> ActivationInputs:
    """The knobs ``activation_terms`` reads."""
    fsdp2 = settings.framework == "fsdp2"
    # built by position (``ActivationInputs``' fields in declaration order), as above
    fields = (
        settings.tp,
        settings.pp,
        settings.ep,
        settings.cp,
        settings.sequence_parallel,
        settings.micro_batch,
        settings.seq_len,
        settings.param_bytes,  # act_bytes
        settings.eager_attention,
        settings.capacity_factor,
        settings.imbalance,
        fsdp2,  # gathered_tp_inputs
        fsdp2,  # edges
        settings.loss_impl,
        settings.loss_chunks,
        fsdp2 and settings.cp > 1,  # ring_attention
        settings.compiled_layers,
        settings.selective,
        settings.selective_op,
        settings.checkpoint_every,
        settings.pp_schedule in V_SHAPED,  # v_shaped
    )
    return _new(ActivationInputs, fields)


# Spec-dependent memo of ``stage_parts``: keyed by the identity of the model (and coefficients)
# and each half's inputs; the entry keeps the keyed objects alive so an id cannot be reused.
# Each weighs the spec (and coefficients) it keeps alive and its terms. A states entry also
# keeps each stage's ``stage_constants`` and host bytes (``stages_states``, the verdict's).
_CACHE_SIZE = 8192
_StatesKey = tuple[int, tuple[int, ...], StatesInputs]
_ActsKey = tuple[int, int, tuple[int, ...], ActivationInputs]
_StatesEntry = tuple[
    ModelSpec, tuple[ModelStates, ...], tuple[StageConstants, ...], tuple[HostBytes, ...]
]
_STATES: BoundedDict[_StatesKey, _StatesEntry] = BoundedDict(_CACHE_SIZE, 12 << 20)
_ACTS: BoundedDict[_ActsKey, tuple[ModelSpec, Coefficients, tuple[ActivationTerms, ...]]] = (
    BoundedDict(_CACHE_SIZE, 12 << 20)
)


def stages_states(
    model: ModelSpec, settings: Knobs, coeffs: Coefficients, stages: tuple[int, ...]
) -> _StatesEntry:
    """Persistent state of each of ``stages`` (in order), its ``stage_constants`` and its host
    bytes, memoised (after the model the entry keeps alive)."""
    inputs = states_inputs(settings, coeffs)
    key = (id(model), stages, inputs)
    hit = _STATES.get(key)
    if hit is None:
        states_now = tuple(model_states(model, s, inputs) for s in stages)
        streaming = inputs.offload_mode == "streaming"
        constants = tuple(
            stage_constants(states, streaming, inputs.accumulating) for states in states_now
        )
        weight = spec_bytes(model) + sum(map(states_bytes, states_now))
        weight += CONSTANTS_BYTES * len(stages)
        hosts = tuple([states.host for states in states_now])
        hit = _STATES.put(key, (model, states_now, constants, hosts), weight)
    return hit


def stage_parts(
    model: ModelSpec, settings: Knobs, coeffs: Coefficients, stages: tuple[int, ...]
) -> tuple[tuple[ModelStates, ...], tuple[ActivationTerms, ...]]:
    """Persistent state and activation terms of each of ``stages`` (in order), memoised."""
    states = stages_states(model, settings, coeffs, stages)[1]
    act_inputs = activation_inputs(settings)
    akey = (id(model), id(coeffs), stages, act_inputs)
    ahit = _ACTS.get(akey)
    if ahit is None:
        sps = [stage_states.stage_params for stage_states in states]
        acts = stages_activation_terms(model, coeffs, sps, act_inputs)
        weight = spec_bytes(model) + coefficients_bytes(coeffs) + sum(map(terms_bytes, acts))
        ahit = _ACTS.put(akey, (model, coeffs, acts), weight)
    return states, ahit[2]


def stage_terms_from_knobs(
    model: ModelSpec, settings: Knobs, coeffs: Coefficients, stage: int
) -> StageTerms:
    """Every term of ``stage`` under ``settings`` (``evaluate``'s, for its views and
    ``explain``)."""
    (states,), (acts,) = stage_parts(model, settings, coeffs, (stage,))
    return StageTerms(
        states=states,
        activations=acts,
        in_flight=in_flight(
            settings.pp, settings.vpp, stage, settings.grad_accum, settings.pp_schedule
        ),
        checkpoint_every=settings.checkpoint_every,
        streaming=settings.offload_mode == "streaming",
        accumulating=settings.grad_accum > 1,
    )


def check_interleaving(model: ModelSpec, pp: int, vpp: int) -> None:
    """Interleaving splits each stage's layers into ``vpp`` equal model chunks."""
    if vpp > 1 and model.num_layers % (pp * vpp):
        allowed = [
            v for v in range(1, model.num_layers // pp + 1) if model.num_layers % (pp * v) == 0
        ]
        raise SpecError(
            f"train.parallel.vpp: num_layers ({model.num_layers}) must divide into pp x vpp "
            f"equal chunks; allowed with pp={pp}: {', '.join(map(str, allowed[:16]))}; got {vpp}",
            field="train.parallel.vpp",
        )


class Peak(NamedTuple):
    """The GPU peak over some stages."""

    gpu_bytes: int  # allocated + CUDA context + allocator overhead
    stage_index: int  # index of the peak stage in the stages asked about
    phase_index: int  # index of the peak phase in PHASES


def stages_allocated(
    all_states: tuple[ModelStates, ...],
    all_acts: tuple[ActivationTerms, ...],
    stages: tuple[int, ...],
    grad_accum: int,
    streaming: bool,
    vpp: int = 1,
    schedule: str | None = None,
) -> tuple[StageAllocated, ...]:
    """The largest phase of each of ``stages`` (the last is the pipeline's last stage)."""
    pp = stages[-1] + 1
    accumulating = grad_accum > 1
    out = []
    for i, stage in enumerate(stages):
        flight = in_flight(pp, vpp, stage, grad_accum, schedule)
        largest = largest_phase(all_states[i], all_acts[i], flight, streaming, accumulating)
        out.append(_new(StageAllocated, largest))  # (allocated_bytes, phase_index)
    return tuple(out)


def gpu_peak(allocated: tuple[StageAllocated, ...], over: Overheads) -> Peak:
    """The GPU peak over stages whose largest phases are ``allocated`` (the first of equal
    stages wins)."""
    context, fraction = over
    if len(allocated) == 1:
        stage_bytes, phase_index = allocated[0]
        overhead = b.allocator_overhead_bytes(stage_bytes, fraction)
        return _new(Peak, (stage_bytes + context + overhead, 0, phase_index))
    best, where, index = -1, 0, 0
    for i, (stage_bytes, phase_index) in enumerate(allocated):
        total = stage_bytes + context + b.allocator_overhead_bytes(stage_bytes, fraction)
        if total > best:
            best, where, index = total, i, phase_index
    return _new(Peak, (best, where, index))


def end_stages(
    model: ModelSpec, settings: Knobs, coeffs: Coefficients
) -> tuple[tuple[StageAllocated, ...], tuple[HostBytes, ...]]:
    """The largest phase and the host bytes of each stage that can be the heaviest: the first
    and, when pp > 1, the last."""
    pp, vpp, grad_accum = settings.pp, settings.vpp, settings.grad_accum
    schedule = settings.pp_schedule
    # micro-batches in flight on a stage: the schedule's (``in_flight``)
    stages: tuple[int, ...]
    in_flights: tuple[int, ...]
    if pp == 1:
        stages, in_flights = (0,), (1,)
    else:
        stages = (0, pp - 1)
        in_flights = (
            in_flight(pp, vpp, 0, grad_accum, schedule),
            in_flight(pp, vpp, pp - 1, grad_accum, schedule),
        )
    _, _, constants, hosts = stages_states(model, settings, coeffs, stages)
    largest = stages_largest(
        model,
        coeffs,
        constants,
        activation_inputs(settings),
        in_flights,
        settings.offload_mode == "streaming",
    )
    return largest, hosts


#: ``estimate``'s memo of ``end_stages``: (model, knobs, coefficients) by identity -> (the
#: objects, kept alive so their ids stay unique; the end stages). A spec's knobs are one object
#: (``knobs`` is memoised per spec), so a service asked the same question again reads its
#: stages' verdicts here. ``evaluate`` does not use it: a search's candidates are new knobs
#: each (``_replace``), which could never be found again.
_ENDS: BoundedDict[
    tuple[int, int, int],
    tuple[
        tuple[ModelSpec, Knobs, Coefficients],
        tuple[tuple[StageAllocated, ...], tuple[HostBytes, ...]],
    ],
] = BoundedDict(4096, 4 << 20)


def _memoised_end_stages(
    model: ModelSpec, settings: Knobs, coeffs: Coefficients
) -> tuple[tuple[StageAllocated, ...], tuple[HostBytes, ...]]:
    """``end_stages``, memoised by the identity of the model, knobs and coefficients."""
    key = (id(model), id(settings), id(coeffs))
    hit = _ENDS.get(key)
    if hit is not None:
        return hit[1]
    ends = end_stages(model, settings, coeffs)
    weight = SMALL_ENTRY_BYTES + spec_bytes(model) + coefficients_bytes(coeffs)
    return _ENDS.put(key, ((model, settings, coeffs), ends), weight)[1]


def stage_terms(
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    stage: int,
    coefficients: Coefficients | None = None,
) -> tuple[StageTerms, Coefficients]:
    """One stage's terms (``explain`` asks for the estimate's heaviest) and the coefficients."""
    coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
    return stage_terms_from_knobs(model, knobs(train), coeffs, stage), coeffs


def estimate(
    model: ModelSpec, train: TrainSpec, hardware: Hardware, coefficients: Coefficients | None = None
) -> Budget:
    """Predict per-bucket GPU and host bytes on the heaviest rank, the peak and its phase."""
    settings = knobs(train)
    coeffs = coefficients or default_coefficients(settings.activation_profile, hardware.name)
    check_priced(model, settings, coeffs)
    return _budget(model, settings, hardware, coeffs, _memoised_end_stages(model, settings, coeffs))


class StagePeak(NamedTuple):
    """One end stage's largest phase, in the figures a GPU run reports."""

    stage: int  # the pipeline stage (0: the first; pp - 1: the last)
    allocated_bytes: int  # what ``allocated_bytes.all.peak`` counts
    reserved_bytes: int  # with the caching allocator's overhead (``reserved_bytes.all.peak``)
    peak_bytes: int  # with the CUDA context too (what ``nvidia-smi`` shows)
    phase: str


def stage_peaks(
    model: ModelSpec, train: TrainSpec, hardware: Hardware, coefficients: Coefficients | None = None
) -> tuple[StagePeak, ...]:
    """The largest phase of each stage that can be the heaviest (the first and, when
    ``parallel.pp`` > 1, the last), each as allocated, reserved and whole-GPU bytes.

    ``estimate`` reports the heaviest of them. A run that logs one rank's figure (Megatron-LM
    writes its memory statistics from the last rank only) is compared with that rank's stage.
    """
    settings = knobs(train)
    coeffs = coefficients or default_coefficients(settings.activation_profile, hardware.name)
    check_priced(model, settings, coeffs)
    allocated, _ = _memoised_end_stages(model, settings, coeffs)
    context, fraction = overheads(coeffs, hardware, settings.expandable_segments)
    out = []
    for i, (stage_bytes, phase_index) in enumerate(allocated):
        reserved = stage_bytes + b.allocator_overhead_bytes(stage_bytes, fraction)
        stage = i * (settings.pp - 1)
        out.append(StagePeak(stage, stage_bytes, reserved, reserved + context, PHASES[phase_index]))
    return tuple(out)


def evaluate(
    model: ModelSpec, settings: Knobs, hardware: Hardware, coefficients: Coefficients | None = None
) -> Budget:
    """``estimate`` on flattened knobs: what a search calls with ``knobs(train)._replace(...)``.

    Knobs made by ``_replace`` skip ``TrainSpec`` validation: the caller keeps them in range.
    """
    coeffs = coefficients or default_coefficients(settings.activation_profile, hardware.name)
    check_priced(model, settings, coeffs)
    return _budget(model, settings, hardware, coeffs, end_stages(model, settings, coeffs))


def check_priced(model: ModelSpec, settings: Knobs, coeffs: Coefficients) -> None:
    """A SpecError naming the field where ``model`` under ``settings`` is something the
    estimate does not price: an interleaved schedule that does not split the layers (a V
    schedule's chunks may be uneven: ``planner.stage.v_chunks``), an MoE model under a profile
    traced on dense layers only, ``selective_op`` where it is not priced (``estimate`` and
    ``evaluate`` both ask)."""
    if settings.vpp > 1 and settings.pp_schedule not in V_SHAPED:
        check_interleaving(model, settings.pp, settings.vpp)
    if model.moe is not None and not coeffs.moe_traced:
        raise_untraced_moe(coeffs)
    if settings.selective_op:
        check_selective_op(model, coeffs)
    if settings.compiled_layers:
        check_compiled_layers(settings, coeffs)


def check_compiled_layers(settings: Knobs, coeffs: Coefficients) -> None:
    """``compile`` is priced by a profile whose compiled layer was traced
    (``Coefficients.compiled_layer_hidden_tensors``), as traced: 16-bit activations, one
    tensor-parallel rank. A SpecError naming ``compile`` otherwise."""
    if coeffs.compiled_layer_hidden_tensors is None or coeffs.compiled_layer_ffn_tensors is None:
        having = [p for p in profiles() if default_coefficients(p).compiled_layer_hidden_tensors]
        raise SpecError(
            f"compile: the {coeffs.profile} profile has no compiled layer traced (what "
            "torch.compile saves depends on the model code); profiles that price it: "
            f"{', '.join(having) or 'none'}; or set compile false",
            field="compile",
        )
    if settings.param_bytes != 2:
        raise SpecError(
            "compile: a compiled layer is priced at 16-bit activations, as traced; allowed "
            f"with precision.params bf16 or fp16 (got {settings.param_bytes}-byte params)",
            field="compile",
        )
    if settings.tp > 1:
        raise SpecError(
            "compile: a compiled layer is priced on one tensor-parallel rank, as traced; "
            f"allowed with parallel.tp 1 (got {settings.tp})",
            field="compile",
        )


def raise_untraced_moe(coeffs: Coefficients) -> NoReturn:
    """A SpecError naming ``activation_profile``: ``coeffs`` were fitted to dense layers, so
    an MoE layer's experts would count nothing; the profiles with MoE terms are named."""
    having = [p for p in profiles() if default_coefficients(p).moe_traced]
    raise SpecError(
        f"activation_profile: the {coeffs.profile} profile has no MoE terms (its traces are of "
        f"dense layers); an MoE model needs one of: {', '.join(having)}",
        field="activation_profile",
    )


#: the profiles whose model code runs torchtitan's per-op policy (its own ``SelectiveAC``): the
#: searches (``planner.fit``, ``planner.plan``) propose ``selective_op`` to these only, as the
#: other implementations have no such policy to switch to
SELECTIVE_OP_PROFILES = ("torchtitan",)


def selective_op_priced(model: ModelSpec, coeffs: Coefficients) -> bool:
    """Whether ``recompute: selective_op`` is priced for ``model`` under ``coeffs``
    (``check_selective_op`` says why not)."""
    return coeffs.selective_op and model.moe is None and model.mla is None


def selective_op_offered(model: ModelSpec, coeffs: Coefficients) -> bool:
    """Whether a search should try ``recompute: selective_op`` (parallel.cp 1 aside): priced,
    and the profile's model code runs it."""
    return coeffs.profile in SELECTIVE_OP_PROFILES and selective_op_priced(model, coeffs)


def check_selective_op(model: ModelSpec, coeffs: Coefficients) -> None:
    """``recompute: selective_op`` (torchtitan's per-op selective checkpointing) is priced by
    a profile that traced it or derives it (``Coefficients.selective_op``), for dense layers
    with grouped-query attention: which of a block's matmuls the policy keeps is counted in
    torchtitan's Llama order, and an MoE layer's routing and experts or MLA's projections
    change the count. A SpecError naming ``recompute`` otherwise, never another policy's
    price."""
    if not coeffs.selective_op:
        having = [p for p in profiles() if default_coefficients(p).selective_op]
        raise SpecError(
            f"recompute: the {coeffs.profile} profile does not price selective_op "
            "(torchtitan's per-op selective checkpointing; none of its traces ran it); "
            f"profiles that do: {', '.join(having)}; or use none, selective, full or every_k",
            field="recompute",
        )
    if model.moe is not None or model.mla is not None:
        kinds = [k for k, on in (("MoE", model.moe), ("MLA", model.mla)) if on is not None]
        raise SpecError(
            "recompute: selective_op is priced for dense layers with grouped-query attention "
            f"(torchtitan's Llama 3 block); {model.name} is an {' and '.join(kinds)} model, "
            "whose matmuls the policy counts differently; allowed for it: none, selective, "
            "full or every_k",
            field="recompute",
        )


def _budget(
    model: ModelSpec,
    settings: Knobs,
    hardware: Hardware,
    coeffs: Coefficients,
    ends: tuple[tuple[StageAllocated, ...], tuple[HostBytes, ...]],
) -> Budget:
    """The verdict and the Budget from the end stages' largest phases and host bytes."""
    allocated, hosts = ends
    over = overheads(coeffs, hardware, settings.expandable_segments)
    pp = settings.pp
    peak_bytes, i, index = gpu_peak(allocated, over)
    stage, host = i * (pp - 1), hosts[i]  # the first stage, or the last
    capacity = hardware.memory_bytes
    ranks = min(hardware.gpus_per_node, settings.dp * settings.tp * pp * settings.cp)
    host_peak = sum(host) * ranks
    host_cap = hardware.host_memory_bytes
    margin = math.ceil(peak_bytes * coeffs.margin_fraction)
    fits = peak_bytes + margin <= capacity and (host_cap is None or host_peak <= host_cap)
    warnings = []
    if settings.ema == "gpu" and settings.offload_mode == "streaming":
        warnings.append("ema: streaming keeps the EMA in host RAM; 'gpu' was treated as 'host'")
    if host_cap is None and host_peak:
        warnings.append("host: no --host-memory given; host RAM was not checked")
    # options the profile's traces never ran (``planner.untraced``)
    warnings += untraced_warnings(
        model, coeffs, settings.eager_attention, settings.cp, settings.param_bytes
    )
    context, fraction = over
    # by position (``Budget``'s parameters in declaration order; see its docstring)
    return Budget(
        PHASES[index],  # peak_phase
        fits,
        stage,
        margin,  # margin_bytes
        warnings,
        peak_bytes,  # gpu_peak_bytes
        host_peak,  # host_peak_bytes
        model,
        hardware.name,  # hardware_name
        capacity,
        lambda: stage_terms_from_knobs(model, settings, coeffs, stage).rows(),  # rows
        context,
        fraction,  # allocator_overhead_fraction
        host,
        ranks,
        host_cap,  # host_capacity
        coeffs,
    )


def layer_backward_bytes(
    model: ModelSpec, train: TrainSpec, coefficients: Coefficients | None = None
) -> int:
    """Allocated bytes of the first stage at the largest of its backward points in the steady
    state: the peak while one of its layers' backward runs (calibration compares it with the
    largest a trace saw inside a decoder layer's backward)."""
    settings = knobs(train)
    t = stage_terms_from_knobs(
        model, settings, coefficients or default_coefficients(settings.activation_profile), 0
    )
    s = t.states
    layer = stage_layer_backward(s, t.activations, t.in_flight)
    through = sum(layer) if layer is not None else 0
    return s.params + s.master_params + s.ema + s.optimizer_states + through


def clear_spec_caches() -> None:
    """Forget every memoised spec-dependent term (model-derived facts stay cached)."""
    _STATES.clear()
    _ACTS.clear()
    knobs.cache_clear()
    _ENDS.clear()
    clear_layer_shapes()
