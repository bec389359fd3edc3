"""One configuration under every framework and model implementation, side by side.

``compare`` estimates ``train`` once per (framework, activation profile) pair the planner knows:
the frameworks of ``planner.train.FRAMEWORKS`` and every profile with shipped coefficients. A
framework that fixes part of the layout gets it (``fsdp2``: ZeRO stage 3 and no offload;
``deepspeed``: ZeRO stage 1 at least, no streaming; ``megatron``: ZeRO 1 and up as its
distributed optimizer, no streaming), and the comparison says which keys it
changed; a pair the spec cannot run says why instead of a budget.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from headroom.planner.coefficients import profiles
from headroom.planner.errors import SpecError
from headroom.planner.estimator import FRAMEWORK_RULES, estimate
from headroom.planner.hardware import Hardware
from headroom.planner.model import ModelSpec
from headroom.planner.train import FRAMEWORKS, TrainSpec


class Comparison(BaseModel):
    """The estimate of one (framework, activation profile) pair."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    framework: str
    activation_profile: str
    changed: dict[str, Any]  # keys the framework fixes, as set for it ("parallel.zero_stage": 3)
    fits: bool | None  # None: the pair cannot run this configuration (``error`` says why)
    gpu_peak_bytes: int | None
    peak_phase: str | None
    peak_buckets: dict[str, int] | None  # the GPU buckets of the peak phase
    host_peak_bytes: int | None
    error: str | None


def _for_framework(train: TrainSpec, framework: str) -> tuple[TrainSpec, dict[str, Any]]:
    """``train`` under ``framework``, with the keys the framework fixes set (and named)."""
    changed: dict[str, Any] = {}
    data = train.model_dump()
    data["framework"] = framework
    rules = FRAMEWORK_RULES.get(framework)
    if rules is None:
        return TrainSpec.model_validate(data), changed
    zero = train.parallel.zero_stage
    if zero not in rules.zero_stages:  # the nearest stage it runs
        nearest = min(rules.zero_stages, key=lambda z: abs(z - zero))
        changed["parallel.zero_stage"] = data["parallel"]["zero_stage"] = nearest
    if framework == "megatron":
        # ZeRO 1 and up is Megatron's distributed optimizer; the stage key itself stays 0
        sharded = zero >= 1
        if train.megatron.use_distributed_optimizer != sharded:
            changed["megatron.use_distributed_optimizer"] = sharded
            data["megatron"]["use_distributed_optimizer"] = sharded
    if train.offload.mode not in rules.offload_modes:
        changed["offload.mode"] = "none"
        data["offload"] = {"mode": "none"}
    return TrainSpec.model_validate(data), changed


def compare(model: ModelSpec, train: TrainSpec, hardware: Hardware) -> list[Comparison]:
    """``train`` estimated under every framework and activation profile (frameworks in
    ``FRAMEWORKS`` order, profiles by name)."""
    out = []
    for framework in FRAMEWORKS:
        under, changed = _for_framework(train, framework)
        for profile in profiles():
            spec = under.model_copy(update={"activation_profile": profile})
            try:
                budget = estimate(model, spec, hardware)
            except SpecError as exc:
                out.append(
                    Comparison(
                        framework=framework,
                        activation_profile=profile,
                        changed=changed,
                        fits=None,
                        gpu_peak_bytes=None,
                        peak_phase=None,
                        peak_buckets=None,
                        host_peak_bytes=None,
                        error=str(exc),
                    )
                )
                continue
            out.append(
                Comparison(
                    framework=framework,
                    activation_profile=profile,
                    changed=changed,
                    fits=budget.fits,
                    gpu_peak_bytes=budget.gpu_peak_bytes,
                    peak_phase=budget.peak_phase,
                    peak_buckets=dict(budget.gpu.phases[budget.peak_phase].buckets),
                    host_peak_bytes=budget.host_peak_bytes,
                    error=None,
                )
            )
    return out
