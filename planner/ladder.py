"""The auto-fit ladder: the fastest configuration that fits, found analytically.

Candidates span: offload none → optimizer fractions 0.125 … 1.0 → streaming (checkpoint every
1, 2, 4, 8, 16 layers); every power-of-two micro-batch that divides the global batch per rank,
with gradient accumulation set to keep it (within ``TrainSpec``'s bounds); recompute none →
selective → (torchtitan's per-op selective_op, for the torchtitan profile's dense models
without context parallelism: its own model code runs it) → every-K (powers of two below the
layer count) → full; ZeRO stages up to 3 where
data parallelism allows (under ``framework: fsdp2`` ZeRO-3 and no offload, which it fixes); the
allocator's expandable segments on or as given. Each candidate is
estimated (``planner.evaluate`` on flattened knobs, no spec validation per candidate); the ones
whose peak plus margin fits the GPU and whose host buckets fit host RAM are ranked by predicted
tokens per second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from headroom.planner.activations import ActivationTerms
from headroom.planner.budget import BudgetModel
from headroom.planner.coefficients import Coefficients, default_coefficients
from headroom.planner.estimator import (
    FRAMEWORK_RULES,
    Knobs,
    estimate,
    gpu_peak,
    knobs,
    overheads,
    selective_op_offered,
    stage_parts,
    stages_allocated,
)
from headroom.planner.hardware import Hardware
from headroom.planner.model import ModelSpec
from headroom.planner.phases import StageAllocated
from headroom.planner.states import ModelStates
from headroom.planner.steptime import StepModel, StepTime
from headroom.planner.train import MAX_GRAD_ACCUM, TrainSpec
from headroom.planner.units import over_gpu, over_host

#: optimizer-offload fractions (whole tensors in order, so a finer grid buys little)
OFFLOAD_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
#: streaming: layers per checkpointed block
STREAMING_EVERY = (1, 2, 4, 8, 16)
#: largest micro-batch the ladder proposes (it never exceeds the global batch per rank)
MAX_MICRO_BATCH = 1024


class Considered(BaseModel):
    """One candidate in the spec's own terms, with what the estimate said of it."""

    changes: dict[str, Any] = Field(description="Training-spec keys that differ from the input.")
    gpu_peak_bytes: int
    host_peak_bytes: int
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    reason: str | None = Field(default=None, description="Why it was rejected.")


class FitResult(BaseModel):
    """The chosen plan, the runners-up, and why the others were rejected."""

    fits: bool
    plan: dict[str, Any] | None = Field(description="The chosen training spec (planner keys).")
    budget: BudgetModel | None
    predicted_step_seconds: float | None
    predicted_tokens_per_second: float | None
    candidates_considered: int
    candidates_fitting: int
    runners_up: list[Considered]
    rejected: list[Considered] = Field(description="Rejected candidates (the first few).")
    rejected_total: int
    margin_pct: float | None = Field(
        default=None, description="Safety margin applied (None: the coefficients' own)."
    )
    excluded: int = Field(default=0, description="Candidates skipped as already tried.")
    reason: str


Choice = tuple[dict[str, Any], dict[str, Any], bool]


class Grid(NamedTuple):
    """The ladder's dimensions; a candidate is one choice from each. Each choice is (knob
    values, the training-spec keys it sets, whether that differs from the input spec)."""

    micro: list[Choice]
    placements: list[Choice]
    zeros: list[Choice]
    segments: list[Choice]
    recompute: list[Choice]


def _recompute_choices(
    num_layers: int, selective_op: bool
) -> list[tuple[Any, bool, bool, int | None]]:
    """(policy, selective, selective_op, layers per block) of each recompute the ladder tries,
    torchtitan's per-op policy where ``selective_op``."""
    every = []
    k = 2
    while k < num_layers:
        every.append(k)
        k *= 2
    options: list[tuple[Any, bool, bool, int | None]] = [
        ("none", False, False, None),
        ("selective", True, False, None),
    ]
    if selective_op:
        options.append(("selective_op", False, True, None))
    options += [({"every_k": k}, False, False, k) for k in reversed(every)]
    options.append(("full", False, False, 1))
    return options


def grid(model: ModelSpec, train: TrainSpec, coefficients: Coefficients | None = None) -> Grid:
    """The ladder's dimensions for ``train`` (see the module docstring) under ``coefficients``
    (default: its profile's shipped set)."""
    coeffs = coefficients or default_coefficients(train.activation_profile)
    p = train.parallel
    batch = train.micro_batch_size * train.grad_accum_steps
    current = ladder_keys(train)

    def differs(keys: dict[str, Any]) -> bool:
        return any(current[k] != v for k, v in keys.items())

    micro = []
    m = 1
    while m <= min(batch, MAX_MICRO_BATCH):
        # a shape needing more steps than a spec may hold is no plan (the input's own is)
        if batch % m == 0 and batch // m <= MAX_GRAD_ACCUM:
            keys = {"micro_batch_size": m, "grad_accum_steps": batch // m}
            micro.append(({"micro_batch": m, "grad_accum": batch // m}, keys, differs(keys)))
        m *= 2
    if not any(not changed for _, _, changed in micro):  # the input's own shape is a candidate
        m = train.micro_batch_size
        micro.append(
            (
                {"micro_batch": m, "grad_accum": train.grad_accum_steps},
                {"micro_batch_size": m, "grad_accum_steps": train.grad_accum_steps},
                False,
            )
        )
    placements: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"offload_mode": "none", "offload_fraction": 1.0}, {"offload": {"mode": "none"}})
    ]
    # a framework runs the offload modes and ZeRO stages its rules allow
    rules = FRAMEWORK_RULES.get(train.framework)
    modes = rules.offload_modes if rules is not None else ("none", "optimizer", "streaming")
    placements += [
        (
            {"offload_mode": "optimizer", "offload_fraction": f},
            {"offload": {"mode": "optimizer", "fraction": f}},
        )
        for f in OFFLOAD_FRACTIONS
        if "optimizer" in modes
    ]
    if p.tp == 1 and p.pp == 1 and "streaming" in modes:
        placements += [
            (
                {"offload_mode": "streaming", "offload_fraction": 1.0, "checkpoint_every": k},
                {"offload": {"mode": "streaming", "checkpoint_every": k}},
            )
            for k in STREAMING_EVERY
            if k <= max(model.num_layers, 1) or k == 1
        ]
    zero_range: tuple[int, ...] = (
        tuple(range(p.zero_stage, 4)) if p.dp * p.cp > 1 else (p.zero_stage,)
    )
    if rules is not None:
        zero_range = tuple(z for z in zero_range if z in rules.zero_stages)
    zeros = [({"zero_stage": z}, {"parallel.zero_stage": z}) for z in zero_range]
    segments = [
        ({"expandable_segments": e}, {"expandable_segments": e})
        for e in dict.fromkeys((train.expandable_segments, True))
    ]
    offers_op = p.cp == 1 and selective_op_offered(model, coeffs)
    recompute = [
        (
            {"selective": selective, "selective_op": op, "checkpoint_every": k},
            {"recompute": policy},
        )
        for policy, selective, op, k in _recompute_choices(model.num_layers, offers_op)
    ]

    def marked(choices: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[Choice]:
        return [(knob_values, keys, differs(keys)) for knob_values, keys in choices]

    return Grid(micro, marked(placements), marked(zeros), marked(segments), marked(recompute))


def _combine(base: Knobs, choices: tuple[Choice, ...]) -> tuple[Knobs, dict[str, Any], int]:
    """One candidate from one choice per dimension, applied in order (the placement last, so
    streaming's block size wins): (knobs, the spec keys it sets, how many differ from input)."""
    values: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    changed = 0
    for knob_values, spec_keys, differs in choices:
        values.update(knob_values)
        keys.update(spec_keys)
        changed += differs
    return base._replace(**values), keys, changed


def candidates(model: ModelSpec, train: TrainSpec) -> list[tuple[Knobs, dict[str, Any]]]:
    """Every ladder candidate as (knobs, the training-spec keys it sets)."""
    base = knobs(train)
    g = grid(model, train)
    out = []
    for mb in g.micro:
        for pl in g.placements:
            streaming = pl[0]["offload_mode"] == "streaming"
            for z in g.zeros:
                for es in g.segments:
                    for rc in g.recompute[:1] if streaming else g.recompute:
                        settings, keys, _ = _combine(base, (mb, z, es, rc, pl))
                        out.append((settings, keys))
    return out


def _plan(train: TrainSpec, changes: dict[str, Any]) -> TrainSpec:
    data = train.model_dump()
    for key, value in changes.items():
        if key == "parallel.zero_stage":
            data["parallel"]["zero_stage"] = value
        elif key == "offload":
            data["offload"] = {"num_buffers": train.offload.num_buffers, **value}
        else:
            data[key] = value
    return TrainSpec.model_validate(data)


def ladder_keys(spec: TrainSpec) -> dict[str, Any]:
    """The training-spec keys the ladder sets, as ``spec`` has them: what ``_plan`` applies,
    read back (``candidate_key``'s input; a streaming block of None is 1)."""
    offload: dict[str, Any] = {"mode": spec.offload.mode}
    if spec.offload.mode == "optimizer":
        offload["fraction"] = spec.offload.fraction
    elif spec.offload.mode == "streaming":
        offload["checkpoint_every"] = spec.offload.checkpoint_every or 1
    recompute = spec.recompute if isinstance(spec.recompute, str) else spec.recompute.model_dump()
    return {
        "micro_batch_size": spec.micro_batch_size,
        "grad_accum_steps": spec.grad_accum_steps,
        "parallel.zero_stage": spec.parallel.zero_stage,
        "expandable_segments": spec.expandable_segments,
        "recompute": recompute,
        "offload": offload,
    }


def changed_keys(train: TrainSpec, keys: dict[str, Any]) -> dict[str, Any]:
    """The ladder keys in ``keys`` whose values differ from ``train``'s."""
    current = ladder_keys(train)
    return {k: v for k, v in keys.items() if current.get(k) != v}


def candidate_key(changes: dict[str, Any]) -> str:
    """A candidate's identity (its spec keys), to exclude ones already tried."""
    return json.dumps(changes, sort_keys=True)


def fit(
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    coefficients: Coefficients | None = None,
    margin_pct: float | None = None,
    max_listed: int = 20,
    exclude: Collection[str] = (),
    check: Callable[[], None] | None = None,
) -> FitResult:
    """The fastest ladder candidate that fits (see module docstring).

    ``exclude`` holds ``candidate_key``s of candidates not to choose again (a probe ran them out
    of memory). The search walks the grid with the placement and ZeRO choices outside and the
    batch shape and recompute inside, so each half of the estimate is looked up once per value
    and a candidate costs the phase arithmetic and, if it fits, its step time. ``check`` is
    called before each placement, ZeRO stage and allocator mode's candidates; what it raises
    stops the search (a deadline, a client that went away).
    """
    coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
    cap, host_cap = hardware.memory_bytes, hardware.host_memory_bytes
    base = knobs(train)
    g = grid(model, train, coeffs)
    pp = base.pp
    stages = (0, pp - 1) if pp > 1 else (0,)
    ranks = min(hardware.gpus_per_node, base.dp * base.tp * pp * base.cp)
    overheads_of = {e: overheads(coeffs, hardware, e) for e in (False, True)}
    margin_fraction = coeffs.margin_fraction if margin_pct is None else margin_pct / 100
    price = StepModel(model, base.seq_len, base.cp, hardware, coeffs)
    fitting: list[tuple[float, int, int, int, tuple[Choice, ...], StepTime]] = []
    rejected: list[Considered] = []
    rejected_total = considered = excluded = 0
    states_of: dict[tuple[int, int, bool], tuple[ModelStates, ...]] = {}
    acts_of: dict[tuple[int, int], tuple[ActivationTerms, ...]] = {}
    allocated_of: dict[
        tuple[tuple[int, int, bool], tuple[int, int]], tuple[StageAllocated, ...]
    ] = {}
    inner_all = [
        ((mb, rc), {**mb[0], **rc[0]}, mb[2] + rc[2], mb[0]["grad_accum"] > 1, m_i, r_i)
        for m_i, mb in enumerate(g.micro)
        for r_i, rc in enumerate(g.recompute)
    ]
    inner_streaming = [i for i in inner_all if i[5] == 0]
    for p_i, pl in enumerate(g.placements):
        streaming = pl[0]["offload_mode"] == "streaming"
        inner = inner_streaming if streaming else inner_all
        for z in g.zeros:
            for es in g.segments:
                if check is not None:
                    check()
                over = overheads_of[es[0]["expandable_segments"]]
                outer = {**z[0], **es[0], **pl[0]}
                outer_changed = z[2] + es[2] + pl[2]
                for (mb, rc), inner_values, inner_changed, accumulating, m_i, r_i in inner:
                    considered += 1
                    choices = (mb, z, es, rc, pl)
                    if exclude and candidate_key(_combine(base, choices)[1]) in exclude:
                        excluded += 1
                        continue
                    settings = None
                    skey = (p_i, z[0]["zero_stage"], accumulating)
                    all_states = states_of.get(skey)
                    akey = (m_i, -p_i if streaming else r_i)
                    all_acts = acts_of.get(akey)
                    if all_states is None or all_acts is None:
                        settings = base._replace(**{**inner_values, **outer})
                        all_states, all_acts = stage_parts(model, settings, coeffs, stages)
                        states_of[skey], acts_of[akey] = all_states, all_acts
                    # the allocator's modes share a candidate's phases
                    allocated = allocated_of.get((skey, akey))
                    if allocated is None:
                        grad_accum = mb[0]["grad_accum"]
                        allocated = allocated_of[skey, akey] = stages_allocated(
                            all_states,
                            all_acts,
                            stages,
                            grad_accum,
                            streaming,
                            base.vpp,
                            base.pp_schedule,
                        )
                    peak_bytes, where, _ = gpu_peak(allocated, over)
                    host_peak = sum(all_states[where].host) * ranks
                    margin = math.ceil(peak_bytes * margin_fraction)
                    too_big = peak_bytes + margin > cap
                    if too_big or (host_cap is not None and host_peak > host_cap):
                        rejected_total += 1
                        if len(rejected) < max_listed:
                            reason = (
                                over_gpu(peak_bytes, margin, cap)
                                if too_big
                                else over_host(host_peak, host_cap or 0)
                            )
                            rejected.append(
                                Considered(
                                    changes=changed_keys(train, _combine(base, choices)[1]),
                                    gpu_peak_bytes=peak_bytes,
                                    host_peak_bytes=host_peak,
                                    reason=reason,
                                )
                            )
                        continue
                    if settings is None:
                        settings = base._replace(**{**inner_values, **outer})
                    states = all_states[where]
                    sp = states.stage_params
                    t = price(settings, sp.dense_numel + sp.expert_numel, states.offloaded_numel)
                    fitting.append(
                        (
                            t.tokens_per_second,
                            outer_changed + inner_changed,
                            peak_bytes,
                            host_peak,
                            choices,
                            t,
                        )
                    )
    fitting.sort(key=lambda f: (-f[0], f[1], f[2]))
    common = {
        "candidates_considered": considered,
        "candidates_fitting": len(fitting),
        "rejected": rejected,
        "rejected_total": rejected_total,
        "margin_pct": margin_pct,
        "excluded": excluded,
    }
    if not fitting:
        return FitResult(
            fits=False,
            plan=None,
            budget=None,
            predicted_step_seconds=None,
            predicted_tokens_per_second=None,
            runners_up=[],
            reason="no candidate fits: the model states exceed the GPU and host even with "
            "every offload, recompute and ZeRO option",
            **common,
        )
    _, _, _, _, best, t = fitting[0]
    plan = _plan(train, _combine(base, best)[1])
    budget = estimate(model, plan, hardware, coeffs)
    runners_up = [
        Considered(
            changes=changed_keys(train, _combine(base, c)[1]),
            gpu_peak_bytes=listed_peak,
            host_peak_bytes=host_peak,
            step_seconds=st.step_seconds,
            tokens_per_second=st.tokens_per_second,
        )
        for _, _, listed_peak, host_peak, c, st in fitting[1 : 1 + max_listed]
    ]
    return FitResult(
        fits=True,
        plan=plan.model_dump(mode="json"),
        budget=BudgetModel.model_validate(budget.model_dump()),
        predicted_step_seconds=t.step_seconds,
        predicted_tokens_per_second=t.tokens_per_second,
        runners_up=runners_up,
        reason=f"fastest of {len(fitting)} fitting candidate(s) by predicted tokens/s",
        **common,
    )
