"""A run's plan: its validated specs and their estimate, made once and passed along.

``plan_run`` validates what the bundled trainer can train and, with ``fit``, lets the ladder
choose the training spec; ``queue_run`` gates the plan and stores it as a queued run. The
service (``POST /runs``) and ``headroom launch`` both come through here with domain objects,
and the supervisor starts a plan it is handed without validating or estimating it again.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from headroom import planner, store
from headroom.planner.trainable import (
    check_loss,
    check_recompute,
    check_supported,
    runtime_precision,
    working_precision,
)


class NoPlanFits(planner.SpecError):
    """The ladder found no candidate that fits (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"train: {reason}", field="train")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the estimate of a plan's training spec says: the verdict, the GPU's peak (the whole
    GPU's, and the tensors' alone, as the trainer measures it) and the host's."""

    fits: bool
    gpu_peak_bytes: int
    allocated_peak_bytes: int
    host_peak_bytes: int
    peak_phase: str

    @classmethod
    def of(cls, budget: planner.Budget | planner.BudgetModel) -> Prediction:
        if isinstance(budget, planner.Budget):
            return cls(
                fits=budget.fits,
                gpu_peak_bytes=budget.gpu_peak_bytes,
                allocated_peak_bytes=budget.gpu.allocated_peak_bytes,
                host_peak_bytes=budget.host_peak_bytes,
                peak_phase=budget.peak_phase,
            )
        return cls(
            fits=budget.fits,
            gpu_peak_bytes=budget.gpu.peak_bytes,
            allocated_peak_bytes=budget.gpu.allocated_peak_bytes,
            host_peak_bytes=budget.host.peak_bytes,
            peak_phase=budget.peak_phase,
        )


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """Validated specs of a run, with their estimate where one was made."""

    model: planner.ModelSpec
    train: planner.TrainSpec
    hw: planner.Hardware
    prediction: Prediction | None = None
    fitted: planner.FitResult | None = None

    def predicted(self) -> Prediction:
        """The estimate's verdict and peaks (estimated here if the plan came without one)."""
        if self.prediction is not None:
            return self.prediction
        return Prediction.of(planner.estimate(self.model, self.train, self.hw))

    @classmethod
    def estimated(
        cls, model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
    ) -> RunPlan:
        """``train`` as given, estimated once."""
        return cls(
            model=model,
            train=train,
            hw=hw,
            prediction=Prediction.of(planner.estimate(model, train, hw)),
        )

    @classmethod
    def of_fit(
        cls,
        model: planner.ModelSpec,
        result: planner.FitResult,
        hw: planner.Hardware,
        train: planner.TrainSpec | None = None,
    ) -> RunPlan:
        """The ladder's plan (``train``: already validated), with the estimate the ladder made
        of it."""
        if not result.fits or result.plan is None or result.budget is None:
            raise NoPlanFits(result.reason)
        return cls(
            model=model,
            train=train if train is not None else planner.TrainSpec.model_validate(result.plan),
            hw=hw,
            prediction=Prediction.of(result.budget),
            fitted=result,
        )


def plan_run(
    *,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    fit: bool,
    margin_pct: float | None = None,
) -> RunPlan:
    """A plan for the bundled trainer: with ``fit`` the ladder's (``NoPlanFits`` if nothing
    fits), else ``train`` as given; ``SpecError`` for a model the trainer cannot build."""
    check_supported(model)
    if fit:
        return RunPlan.of_fit(model, planner.fit(model, train, hw, margin_pct=margin_pct), hw)
    return RunPlan.estimated(model, train, hw)


def check_launchable(plan: RunPlan, *, gate: bool) -> Prediction:
    """What a run of ``plan`` must pass before it is stored or rendered: with ``gate`` the plan
    must be predicted to fit, as the CI gate would decide; either way the trainer must be able to
    keep its precision. The refusal is a ``SpecError`` naming the field; the prediction."""
    predicted = plan.predicted()
    if gate and not predicted.fits:
        raise planner.SpecError(
            f"train: predicted out of memory on {plan.hw.name} (peak {predicted.gpu_peak_bytes} "
            f"bytes in {predicted.peak_phase}, capacity {plan.hw.memory_bytes}); set fit=true to "
            "let the ladder choose a plan that fits",
            field="train",
        )
    runtime_precision(plan.train, working_precision(plan.train))  # what the trainer cannot keep
    check_recompute(plan.train)  # nor run
    check_loss(plan.train)
    return predicted


def queue_run(
    *,
    session: Session,
    plan: RunPlan,
    steps: int,
    backend: str,
    gate: bool,
    probe: bool = False,
    uid: str | None = None,
    slurm: dict[str, Any] | None = None,
    request: dict[str, Any] | None = None,
) -> tuple[store.Run, bool]:
    """Store ``plan`` as a queued run (idempotent on ``uid``; ``request``: what the client
    asked for, kept with it); (run, created), once ``check_launchable`` lets it through."""
    predicted = check_launchable(plan, gate=gate)
    return store.add_run(
        session=session,
        uid=uid or uuid.uuid4().hex,
        model=plan.model,
        train=plan.train,
        hw=plan.hw,
        predicted_fits=predicted.fits,
        predicted_peak_bytes=predicted.gpu_peak_bytes,
        steps=steps,
        backend=backend,
        probe=probe,
        fitted=plan.fitted,
        slurm=slurm,
        request=request,
    )
