"""The auto-fit ladder: the fastest configuration that fits, found analytically.

Candidates step down from the given spec: offload none → optimizer fractions 0.25 … 1.0 →
streaming (checkpoint every 1, 2, 4, 8 layers); micro-batch halved with gradient accumulation
raised to keep the global batch; recompute none → selective → every-K → full; ZeRO stages up
to 3 where data parallelism allows. Each candidate is estimated (``planner.evaluate`` on
flattened knobs, no spec validation per candidate); the ones whose peak plus margin fits the GPU
and whose host buckets fit host RAM are ranked by predicted tokens per second.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from planner.budget import BudgetModel
from planner.coefficients import Coefficients, default_coefficients
from planner.estimate import Knobs, _stage_terms, estimate, evaluate, knobs
from planner.hardware import Hardware
from planner.model import ModelSpec
from planner.steptime import step_time
from planner.train import TrainSpec

OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
STREAMING_EVERY = (1, 2, 4, 8)
EVERY_K = (8, 4, 2)


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
    reason: str


def _recompute_options(train: TrainSpec, num_layers: int) -> list[tuple[Any, bool, int | None]]:
    options: list[tuple[Any, bool, int | None]] = [("none", False, None), ("selective", True, None)]
    options += [({"every_k": k}, False, k) for k in EVERY_K if k < num_layers]
    options.append(("full", False, 1))
    return options


def candidates(model: ModelSpec, train: TrainSpec) -> list[tuple[Knobs, dict[str, Any]]]:
    """Every ladder candidate as (knobs, the training-spec keys it changes)."""
    base = knobs(train)
    p = train.parallel
    batch = train.micro_batch_size * train.grad_accum_steps
    micro = []
    m = train.micro_batch_size
    while m >= 1:
        if batch % m == 0:
            micro.append((m, batch // m))
        m //= 2
    placements: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"offload": "none"}, {"mode": "none"})
    ]
    placements += [
        ({"offload": "optimizer", "fraction": f}, {"mode": "optimizer", "fraction": f})
        for f in OFFLOAD_FRACTIONS
    ]
    if p.tp == 1 and p.pp == 1:
        placements += [
            (
                {"offload": "streaming", "checkpoint_every": k},
                {"mode": "streaming", "checkpoint_every": k},
            )
            for k in STREAMING_EVERY
        ]
    zeros = range(p.zero_stage, 4) if p.dp * p.cp > 1 else (p.zero_stage,)
    recompute = _recompute_options(train, model.num_layers)
    out: list[tuple[Knobs, dict[str, Any]]] = []
    for (mb, ga), (pk, offload), z in (
        (mg, pl, z) for mg in micro for pl in placements for z in zeros
    ):
        streaming = pk["offload"] == "streaming"
        for policy, selective, k in recompute[:1] if streaming else recompute:
            kn = base._replace(
                micro_batch=mb,
                grad_accum=ga,
                offload=pk["offload"],
                fraction=pk.get("fraction", 1.0),
                selective=selective and not streaming,
                checkpoint_every=pk["checkpoint_every"] if streaming else k,
                zero=z,
            )
            changes: dict[str, Any] = {
                "micro_batch_size": mb,
                "grad_accum_steps": ga,
                "recompute": "none" if streaming else policy,
                "offload": offload,
                "parallel.zero_stage": z,
            }
            out.append((kn, changes))
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


def _diff(train: TrainSpec, changes: dict[str, Any]) -> dict[str, Any]:
    current = {
        "micro_batch_size": train.micro_batch_size,
        "grad_accum_steps": train.grad_accum_steps,
        "recompute": train.recompute
        if isinstance(train.recompute, str)
        else train.recompute.model_dump(),
        "offload": {
            k: v
            for k, v in train.offload.model_dump().items()
            if k in changes["offload"] and k != "num_buffers"
        },
        "parallel.zero_stage": train.parallel.zero_stage,
    }
    return {k: v for k, v in changes.items() if current.get(k) != v}


def fit(
    model: ModelSpec,
    train: TrainSpec,
    hardware: Hardware,
    coefficients: Coefficients | None = None,
    margin_pct: float | None = None,
    max_listed: int = 20,
) -> FitResult:
    """The fastest ladder candidate that fits (see module docstring)."""
    coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
    cap, host_cap = hardware.memory_bytes, hardware.host_memory_bytes
    fitting: list[tuple[float, int, int, dict[str, Any], Any]] = []
    rejected: list[Considered] = []
    rejected_total = 0
    all_candidates = candidates(model, train)
    for kn, changes in all_candidates:
        b = evaluate(model, kn, hardware, coeffs)
        peak = b.gpu_peak_bytes
        margin = b.margin_bytes if margin_pct is None else math.ceil(peak * margin_pct / 100)
        reason = None
        if peak + margin > cap:
            reason = f"GPU peak {peak} B + margin {margin} B > capacity {cap} B ({b.peak_phase})"
        elif host_cap is not None and b.host_peak_bytes > host_cap:
            reason = f"host RAM {b.host_peak_bytes} B > capacity {host_cap} B"
        if reason is not None:
            rejected_total += 1
            if len(rejected) < max_listed:
                rejected.append(
                    Considered(
                        changes=_diff(train, changes),
                        gpu_peak_bytes=peak,
                        host_peak_bytes=b.host_peak_bytes,
                        reason=reason,
                    )
                )
            continue
        t = step_time(model, kn, hardware, coeffs, _stage_terms(model, kn, coeffs, b.stage))
        fitting.append((t.tokens_per_second, peak, b.host_peak_bytes, changes, t))
    fitting.sort(key=lambda f: (-f[0], f[1]))
    if not fitting:
        return FitResult(
            fits=False,
            plan=None,
            budget=None,
            predicted_step_seconds=None,
            predicted_tokens_per_second=None,
            candidates_considered=len(all_candidates),
            candidates_fitting=0,
            runners_up=[],
            rejected=rejected,
            rejected_total=rejected_total,
            reason="no candidate fits: the model states exceed the GPU and host even with "
            "every offload, recompute and ZeRO option",
        )
    _, _, _, changes, t = fitting[0]
    plan = _plan(train, changes)
    budget = estimate(model, plan, hardware, coeffs)
    runners_up = [
        Considered(
            changes=_diff(train, c),
            gpu_peak_bytes=peak,
            host_peak_bytes=host_peak,
            step_seconds=st.step_seconds,
            tokens_per_second=st.tokens_per_second,
        )
        for _, peak, host_peak, c, st in fitting[1 : 1 + max_listed]
    ]
    return FitResult(
        fits=True,
        plan=plan.model_dump(mode="json"),
        budget=BudgetModel.model_validate(budget.model_dump()),
        predicted_step_seconds=t.step_seconds,
        predicted_tokens_per_second=t.tokens_per_second,
        candidates_considered=len(all_candidates),
        candidates_fitting=len(fitting),
        runners_up=runners_up,
        rejected=rejected,
        rejected_total=rejected_total,
        reason=f"fastest of {len(fitting)} fitting candidate(s) by predicted tokens/s",
    )
