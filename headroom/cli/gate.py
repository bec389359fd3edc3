"""``headroom gate``: refuse a launch predicted to OOM, as an exit code and a CI report."""

from __future__ import annotations

import contextlib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from headroom import planner
from headroom.cli.exits import fail, user_errors, writing
from headroom.cli.options import (
    GpuOpt,
    HostOpt,
    MarginOpt,
    ModelArg,
    NodeOpt,
    SetOpt,
    TrainOpt,
    load_specs,
    stored_coefficients,
)


class GateFormat(StrEnum):
    text = "text"
    json = "json"
    github = "github"
    junit = "junit"


def _junit_report(
    model: str, gpu: str, outcome: tuple[str, str, str] | None, out: str | None = None
) -> str:
    """One JUnit test case named for the model and GPU: ``outcome`` (``failure`` or ``error``,
    its message, its type) or a pass, and ``out`` as its system-out."""
    from xml.etree import ElementTree as ET

    kind = outcome[0] if outcome is not None else None
    suite = ET.Element(
        "testsuite",
        name="headroom gate",
        tests="1",
        failures="1" if kind == "failure" else "0",
        errors="1" if kind == "error" else "0",
    )
    case = ET.SubElement(suite, "testcase", classname="headroom.gate", name=f"{model} on {gpu}")
    if outcome is not None:
        tag, message, type_ = outcome
        ET.SubElement(case, tag, message=message, type=type_)
    if out is not None:
        ET.SubElement(case, "system-out").text = out
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def _junit(verdict: planner.Verdict, model: str, gpu: str) -> str:
    """A failure for a predicted OOM, an error when undecided, with the verdict as output."""
    outcome = {
        "oom": ("failure", verdict.reason, "PredictedOOM"),
        "undecided": ("error", verdict.reason, "Undecided"),
    }.get(verdict.decision)
    return _junit_report(model, gpu, outcome, verdict.model_dump_json())


def _invalid_report(format: GateFormat, message: str, model: str, gpu: str) -> str | None:
    """The report of an input the gate could not judge (exit 2), in the CI's own format, so the
    CI page shows why; None for text, whose ``error:`` line is the report."""
    if format is GateFormat.github:
        return f"::error title=Headroom gate::invalid input: {message}"
    if format is GateFormat.json:
        import json

        return json.dumps({"decision": "invalid_input", "reason": message, "exit_code": 2})
    if format is GateFormat.junit:
        return _junit_report(model, gpu, ("error", message, "InvalidInput"))
    return None


def gate_command(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    host_memory: HostOpt = None,
    gpus_per_node: NodeOpt = None,
    margin: MarginOpt = None,
    require_calibration: Annotated[
        bool,
        typer.Option(
            "--require-calibration", help="Exit 3 when the coefficients are uncalibrated."
        ),
    ] = False,
    calibrated: Annotated[
        bool,
        typer.Option(
            "--calibrated",
            help="Judge with the fitted coefficients of the spec's activation profile and the "
            "trust its stack (GPU, framework, profile) has earned from its recent measurements, "
            "as estimate --calibrated does; undecided (exit 3) if the profile has none.",
        ),
    ] = False,
    format: Annotated[
        GateFormat, typer.Option("--format", help="Output format.")
    ] = GateFormat.text,
    output: Annotated[
        Path | None, typer.Option("--output", help="Write the report here instead of stdout.")
    ] = None,
) -> None:
    """Refuse a launch predicted to OOM: exit 0 fits, 1 predicted OOM, 2 invalid input,
    3 cannot decide."""
    try:
        spec, train_spec, hw = load_specs(model, train, set_, gpu, host_memory, gpus_per_node)
        coeffs = None
        if calibrated:
            with contextlib.suppress(planner.NotCalibrated):  # none: undecided, below
                coeffs = stored_coefficients(train_spec, hw)
        budget = planner.estimate(spec, train_spec, hw, coeffs)
        # asked for the stack's calibration, and it has none: undecided, as required
        verdict = planner.gate(budget, margin, require_calibration or calibrated)
    except planner.HeadroomError as exc:
        report = _invalid_report(format, str(exc), model, gpu)
        if report is not None:
            with user_errors():  # an --output the OS refuses: one error line, exit 2
                if output is not None:
                    with writing("--output", output):
                        output.write_text(report + "\n")
                else:
                    typer.echo(report)
        raise fail(str(exc)) from None
    gib = 2**30
    summary = (
        f"{verdict.decision}: {spec.name} on {hw.name}: "
        f"peak {verdict.gpu_peak_bytes / gib:.2f} GiB ({verdict.peak_phase}) "
        f"+ margin {verdict.margin_bytes / gib:.2f} GiB of "
        f"{verdict.gpu_capacity_bytes / gib:.2f} GiB; {verdict.reason}"
    )
    if coeffs is not None:  # the trust the margin came from
        summary += f"; coefficients: {coeffs.profile} ({coeffs.source})"
    if format is GateFormat.json:
        text = verdict.model_dump_json(indent=2)
    elif format is GateFormat.github:
        level = {"fits": "notice", "oom": "error", "undecided": "warning"}[verdict.decision]
        text = f"::{level} title=Headroom gate::{summary}"
    elif format is GateFormat.junit:
        text = _junit(verdict, spec.name, hw.name)
    else:
        text = summary
    if output is not None:
        output.write_text(text + "\n")
        typer.echo(summary, err=True)
    else:
        typer.echo(text)
    # the verdict carries its code: ExitCode.OK, PREDICTED_OOM or UNDECIDED
    raise typer.Exit(verdict.exit_code)
