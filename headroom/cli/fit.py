"""``headroom fit``: the fastest configuration that fits, optionally confirmed by probes.

``resolve_device`` and ``run_autofit`` are shared with ``headroom launch``; the probe ladder, the
trainer and the store are imported only when a probe is asked for (``--probe``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from headroom import planner
from headroom.cli.exits import ExitCode, fail, user_errors
from headroom.cli.options import (
    FormatOpt,
    GpuOpt,
    HostOpt,
    MarginOpt,
    MaxProbesOpt,
    ModelArg,
    NodeOpt,
    ProbeDevice,
    ProbeDeviceOpt,
    ProbeOpt,
    RecordOpt,
    SetOpt,
    TextOrJson,
    TrainOpt,
    load_specs,
)
from headroom.cli.render import changes_text, offload_text, recompute_text

if TYPE_CHECKING:
    from headroom.launch.probing import AutoFitResult


def resolve_device(choice: ProbeDevice) -> str:
    """``cpu`` or ``cuda``: ``auto`` is CUDA when this machine has it."""
    if choice is not ProbeDevice.auto:
        if choice is ProbeDevice.cuda:
            import torch

            if not torch.cuda.is_available():
                raise fail("--probe-device: cuda is not available here; allowed here: cpu, auto")
        return choice.value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_autofit(
    model: str,
    spec: planner.ModelSpec,
    train_spec: planner.TrainSpec,
    hw: planner.Hardware,
    margin: float | None,
    device: str,
    max_probes: int,
    record: bool,
) -> AutoFitResult:
    """The probe ladder on the bundled trainer, each probe stored when ``record``."""
    from headroom.launch.probing import autofit, subprocess_prober

    recorder = None
    if record:
        from headroom.launch.recording import probe_recorder
        from headroom.store import open_store

        recorder = probe_recorder(open_store(), spec, hw)
    prober = subprocess_prober(model, hw, device)
    return autofit(
        spec, train_spec, hw, prober, margin_pct=margin, max_probes=max_probes, record=recorder
    )


def _print_fit(result: planner.FitResult, hw: planner.Hardware, console: Console) -> None:
    console.print(
        f"{result.candidates_considered} candidates, {result.candidates_fitting} fit; "
        f"{result.reason}"
    )
    if result.plan is not None and result.budget is not None:
        p = result.plan
        console.print(
            f"plan: micro_batch_size={p['micro_batch_size']} "
            f"grad_accum_steps={p['grad_accum_steps']} recompute={recompute_text(p['recompute'])} "
            f"offload={offload_text(p['offload'])} zero_stage={p['parallel']['zero_stage']} "
            f"expandable_segments={p['expandable_segments']}"
        )
        console.print(
            f"predicted: {result.predicted_step_seconds:.3f} s/step, "
            f"{result.predicted_tokens_per_second:,.0f} tokens/s, GPU peak "
            f"{planner.format_bytes(result.budget.gpu.peak_bytes)} "
            f"({result.budget.peak_phase}) of {planner.format_bytes(hw.memory_bytes)}"
        )


def _print_probes(auto: AutoFitResult, console: Console) -> None:
    for p in auto.probes:
        o = p.outcome
        measured = (
            planner.format_bytes(o.measured_peak_bytes)
            if o.measured_peak_bytes is not None
            else "n/a"
        )
        verdict = "ok" if o.ok else ("out of memory" if o.oom else f"exit {o.exit_code}")
        console.print(
            f"probe {p.attempt}: {verdict} in {o.seconds:.1f} s; predicted "
            f"{planner.format_bytes(p.predicted_peak_bytes)}, measured {measured}, "
            f"margin {p.margin_pct:g}%, changes: {changes_text(p.changes)}"
        )
    console.print(auto.reason)


def fit_command(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    host_memory: HostOpt = None,
    gpus_per_node: NodeOpt = None,
    margin: MarginOpt = None,
    probe: ProbeOpt = False,
    probe_device: ProbeDeviceOpt = ProbeDevice.auto,
    max_probes: MaxProbesOpt = 3,
    record: RecordOpt = True,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Find the fastest configuration that fits (offload, micro-batch, recompute, ZeRO).
    Exit 0 with a plan, 1 when nothing fits (or no probe confirmed one), 2 on invalid input."""
    auto = None
    with user_errors():
        spec, train_spec, hw = load_specs(model, train, set_, gpu, host_memory, gpus_per_node)
        if probe:
            from headroom.planner.trainable import check_supported, trainer_profile

            check_supported(spec)
            train_spec = trainer_profile(train_spec)  # the probes run the bundled trainer
            auto = run_autofit(
                model,
                spec,
                train_spec,
                hw,
                margin,
                resolve_device(probe_device),
                max_probes,
                record,
            )
            result = auto.fit
        else:
            result = planner.fit(spec, train_spec, hw, margin_pct=margin)
    fits = auto.fits if auto is not None else result.fits
    if format is TextOrJson.json:
        out = result.model_dump(mode="json")
        if auto is not None:
            out.update(
                fits=auto.fits,
                plan=auto.plan,
                probes=[p.model_dump(mode="json") for p in auto.probes],
                margin_pct=auto.margin_pct,
                reason=auto.reason,
            )
        typer.echo(json.dumps(out, indent=2))
    else:
        console = Console()
        _print_fit(result, hw, console)
        if auto is not None:
            _print_probes(auto, console)
    raise typer.Exit(ExitCode.OK if fits else ExitCode.NOTHING_FITS)
