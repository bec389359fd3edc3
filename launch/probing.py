"""Fit, then confirm with a probe: the ladder's plan runs on the bundled trainer into step 2.

The analytical ladder (``planner.fit``) chooses the fastest candidate whose predicted peak plus
margin fits. A probe runs that plan for two optimizer steps (the optimizer state exists from
step 1 on, so step 2 is the steady state) as a subprocess of ``headroom train`` under the
hardware's memory (on CUDA the allocator's per-process cap, on a CPU the simulated device of
``runtime.cap``). If it runs out of memory the prediction was low by at least the cap over the
predicted peak: the margin is widened past that ratio, the plan is excluded, and the ladder
chooses again, up to ``max_probes`` times. Every probe can be recorded as a calibration.

A run's ladder runs as a process of the run's own (``probe_process``), which writes what it
did (``LadderOutcome``) into the run's directory for the supervisor to record.

A probe on the CPU is started only if this host's RAM can hold what the ladder predicts of it,
by the check a run on the CPU passes (``devices.cpu_ram_refusal``): wherever the ladder runs
(``headroom fit --probe``, a served run's probe process, a Slurm job), the host it runs on is
the one checked. A refused probe ends the ladder with the refusal as its reason.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from headroom import planner
from headroom.calibration.attribution import attribute
from headroom.calibration.processes import die_with_parent
from headroom.launch.backends import EXIT_OOM
from headroom.launch.devices import cpu_ram_refusal
from headroom.launch.plan import Prediction
from headroom.launch.rundirs import write_private
from headroom.planner.ladder import FitResult, candidate_key, changed_keys, ladder_keys
from headroom.planner.report import OutOfMemoryAt, TrainerReport, read_report
from headroom.planner.trainable import TORCH_DTYPE, working_precision

#: percentage points a failed probe adds to the margin beyond the error it proved
MARGIN_STEP_PCT = 5.0


class ProbeOutcome(BaseModel):
    """What one probe of a plan showed."""

    exit_code: int
    ok: bool
    oom: bool
    seconds: float
    measured_peak_bytes: int | None = Field(
        default=None, description="Allocated peak the run reached (a lower bound after an OOM)."
    )
    peak_phase: str | None = None
    oom_at: OutOfMemoryAt | None = None
    message: str = ""
    reserved_peak_bytes: int | None = Field(
        default=None, description="The allocator's reserved peak (CUDA only)."
    )
    attribution: dict[str, int] = Field(
        default_factory=dict,
        description="The probe's phase deltas by what holds them (calibration.attribution), "
        "for a run that completed.",
    )


class ProbeRecord(BaseModel):
    """One probe: the plan's spec keys, what the ladder predicted, and what happened."""

    attempt: int
    changes: dict[str, Any]
    margin_pct: float
    predicted_peak_bytes: int
    outcome: ProbeOutcome
    calibration_uid: str | None = None


class AutoFitResult(BaseModel):
    """The plan that a probe confirmed (or why there is none), with every probe made."""

    fits: bool
    plan: dict[str, Any] | None
    fit: FitResult = Field(description="The ladder's answer for the confirmed plan.")
    probes: list[ProbeRecord]
    margin_pct: float = Field(description="The margin the confirmed plan was chosen with.")
    reason: str
    confirmed: planner.TrainSpec | None = Field(
        default=None,
        exclude=True,
        description="The confirmed plan as the validated spec the probe ran (not serialised: "
        "``plan`` is its JSON).",
    )


#: runs one plan of the ladder, given the ladder's estimate of it
Prober = Callable[[planner.TrainSpec, planner.Budget | planner.BudgetModel], ProbeOutcome]
#: stores a probe of a plan with the ladder's estimate of it; the record's uid, if stored
Recorder = Callable[
    [planner.TrainSpec, planner.Budget | planner.BudgetModel, ProbeOutcome], str | None
]


class ProbeRefused(Exception):
    """A probe that was not started: this host could not hold it (the message says why;
    ``autofit`` ends the ladder with it)."""


def probe_cap_bytes(hw: planner.Hardware) -> int:
    """Device bytes a probe may allocate: the card less what the CUDA context takes."""
    return hw.memory_bytes - hw.cuda_context_bytes


def subprocess_prober(
    model_arg: str,
    hw: planner.Hardware,
    device: str,
    steps: int = 2,
    timeout_s: float = 3600,
    workdir: Path | None = None,
) -> Prober:
    """A prober that runs ``headroom train`` (this interpreter, no shell) on each plan, once
    this host's RAM can hold it (``devices.cpu_ram_refusal``, as for a run on the CPU; else
    ``ProbeRefused``). The trainer dies with this process (``die_with_parent``) and stays in
    its process group, so ending the group ends the probe too. With ``workdir`` its files and
    its temporary folder (``TMPDIR``) lie under it, nothing in the system's."""

    def probe(
        plan: planner.TrainSpec, budget: planner.Budget | planner.BudgetModel
    ) -> ProbeOutcome:
        predicted = Prediction.of(budget)
        refusal = cpu_ram_refusal(
            "a probe",
            device=device,
            gpu_peak_bytes=predicted.gpu_peak_bytes,
            host_peak_bytes=predicted.host_peak_bytes,
            cuda_context_bytes=hw.cuda_context_bytes,
        )
        if refusal is not None:
            raise ProbeRefused(refusal)
        env = None
        if workdir is not None:
            scratch = workdir / SCRATCH
            scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
            env = {**os.environ, "TMPDIR": str(scratch)}
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            plan_file = Path(tmp) / "plan.json"
            report_file = Path(tmp) / "report.json"
            write_private(plan_file, json.dumps(plan.model_dump(mode="json")))
            argv = [
                sys.executable,
                "-m",
                "headroom",
                "train",
                model_arg,
                "--train",
                str(plan_file),
                "--steps",
                str(steps),
                "--device",
                device,
                "--dtype",
                TORCH_DTYPE[working_precision(plan)],
                "--memory-cap",
                str(probe_cap_bytes(hw)),
                "--report",
                str(report_file),
            ]
            start = time.perf_counter()
            # started from this thread, which waits for it: the death signal follows the thread
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=workdir,
                env=env,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
            try:
                _, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return ProbeOutcome(
                    exit_code=-1,
                    ok=False,
                    oom=False,
                    seconds=time.perf_counter() - start,
                    message=f"probe timed out after {timeout_s:g} s",
                )
            seconds = time.perf_counter() - start
            report = read_report(report_file)
        return outcome_of(proc.returncode, report, seconds, stderr)

    return probe


def planner_phase(phase: str, step: int) -> str | None:
    """The planner's name for a trainer phase: step 1's forward and backward run before any
    optimizer state exists (``step1_*``); ``placement`` has no planner phase."""
    if phase in ("forward", "backward"):
        return f"step1_{phase}" if step <= 1 else phase
    return "optimizer" if phase == "optimizer" else None


def outcome_of(code: int, report: TrainerReport, seconds: float, stderr: str) -> ProbeOutcome:
    """A probe's outcome from ``headroom train``'s exit code and report."""
    memory = report.memory
    phases = memory.measured_phases if memory is not None else []
    measured = memory.measured_peak_bytes if memory is not None else None
    peak_phase = None
    if phases:
        top = max(phases, key=lambda p: p.allocated_peak_bytes)
        peak_phase = planner_phase(top.phase, top.step)
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return ProbeOutcome(
        reserved_peak_bytes=(memory.reserved_peak_bytes if memory is not None else None) or None,
        attribution=attribute(phases) if code == 0 and phases else {},
        exit_code=code,
        ok=code == 0,
        oom=code == EXIT_OOM,
        seconds=seconds,
        measured_peak_bytes=measured or None,
        peak_phase=peak_phase,
        oom_at=report.oom,
        message=lines[-1] if lines and code else "",
    )


def widened_margin(
    current_pct: float, predicted: int, capacity: int, measured: int | None
) -> float:
    """The margin after a probe ran out of memory: the run needed more than ``capacity`` (at
    least ``measured`` where known), so the estimate was low by at least that over
    ``predicted``; the new margin covers that error and one step more."""
    needed = max(capacity, measured or 0)
    proven_pct = (needed / predicted - 1) * 100 if predicted else 0.0
    return math.ceil(max(current_pct + MARGIN_STEP_PCT, proven_pct + MARGIN_STEP_PCT))


def autofit(
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    prober: Prober,
    coefficients: planner.Coefficients | None = None,
    margin_pct: float | None = None,
    max_probes: int = 3,
    record: Recorder | None = None,
) -> AutoFitResult:
    """The ladder's plan, confirmed by probes, stepping down on out-of-memory (module doc)."""
    coeffs = coefficients or planner.default_coefficients(train.activation_profile, hw.name)
    margin = margin_pct if margin_pct is not None else coeffs.margin_fraction * 100
    tried: set[str] = set()
    probes: list[ProbeRecord] = []
    result = planner.fit(model, train, hw, coeffs, margin_pct=margin)

    def done(reason: str, confirmed: planner.TrainSpec | None = None) -> AutoFitResult:
        return AutoFitResult(
            fits=confirmed is not None,
            plan=result.plan if confirmed is not None else None,
            fit=result,
            probes=probes,
            margin_pct=margin,
            reason=reason,
            confirmed=confirmed,
        )

    for attempt in range(1, max_probes + 1):
        if not result.fits or result.plan is None or result.budget is None:
            return done(
                result.reason
                if not probes
                else f"after {len(probes)} probe(s) out of memory, {result.reason}"
            )
        plan = planner.TrainSpec.model_validate(result.plan)
        budget = result.budget  # the ladder's estimate of this plan, under ``coeffs``
        try:
            outcome = prober(plan, budget)
        except ProbeRefused as exc:
            return done(f"probe {attempt} not run: {exc}")
        uid = record(plan, budget, outcome) if record is not None else None
        probes.append(
            ProbeRecord(
                attempt=attempt,
                changes=changed_keys(train, ladder_keys(plan)),
                margin_pct=margin,
                predicted_peak_bytes=budget.gpu.peak_bytes,
                outcome=outcome,
                calibration_uid=uid,
            )
        )
        if outcome.ok:
            return done(f"probe {attempt} ran the plan into step 2 within the card", plan)
        if not outcome.oom:
            return done(
                f"probe {attempt} failed for a reason other than memory "
                f"(exit {outcome.exit_code}): {outcome.message}"
            )
        tried.add(candidate_key(ladder_keys(plan)))
        margin = widened_margin(
            margin, budget.gpu.peak_bytes, hw.memory_bytes, _with_context(outcome, hw)
        )
        result = planner.fit(model, train, hw, coeffs, margin_pct=margin, exclude=tried)
    return done(f"{max_probes} probe(s) ran out of memory; no plan confirmed")


def _with_context(outcome: ProbeOutcome, hw: planner.Hardware) -> int | None:
    """A probe's measured allocation as a card total (the context is outside the allocator)."""
    if outcome.measured_peak_bytes is None:
        return None
    return outcome.measured_peak_bytes + hw.cuda_context_bytes


#: what a run's probe process (``probe_process``) writes into the run's directory
PROBES_FILE = "probes.json"
#: the run's card, which the probe process fits and caps its probes to
HARDWARE_FILE = "hardware.json"
#: the folder under the run's directory its probes' temporary files go to
SCRATCH = "tmp"
#: the probe process's exit code when no probe confirmed a plan
EXIT_NOT_CONFIRMED = 1


class LadderOutcome(BaseModel):
    """What the probe process of one run did: the ladder's result, and the plan each of its
    probes ran (the n-th probe of ``result.probes`` ran ``probed[n]``)."""

    result: AutoFitResult
    probed: list[planner.TrainSpec] = Field(default_factory=list)


def probe_process_argv(directory: Path, device: str, python: str = sys.executable) -> list[str]:
    """The command that runs the probe ladder of the run in ``directory`` on ``device``
    (``python -m headroom.launch.probe_process``)."""
    return [python, "-m", "headroom.launch.probe_process", str(directory), "--device", device]


def read_outcome(directory: Path) -> LadderOutcome | None:
    """What the probe process wrote into ``directory`` (None: nothing, or not readable as
    that: it is written whole, so a reader never sees half)."""
    try:
        return LadderOutcome.model_validate_json((directory / PROBES_FILE).read_text())
    except (OSError, ValueError):
        return None
