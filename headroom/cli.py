"""The ``headroom`` command line: estimate, presets (and, as they land, gate, fit, train, serve).

User mistakes exit with code 2 and one line on stderr; tracebacks are for bugs.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from headroom import planner
from headroom.launch.backends import EXIT_OOM
from headroom.planner.io import apply_overrides, read_file
from headroom.planner.units import parse_size

app = typer.Typer(
    name="headroom",
    help="Will this training run fit on the GPU, and where does every byte go?",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class TextOrJson(StrEnum):
    text = "text"
    json = "json"


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _train_dict(train_file: Path | None, assignments: list[str]) -> dict[str, Any]:
    data: Any = read_file(train_file) if train_file is not None else {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise planner.InputFormatError(f"{train_file}: expected a JSON/YAML object")
    return apply_overrides(data, assignments)


ModelArg = Annotated[str, typer.Argument(help="Preset name, model JSON/YAML, or config.json.")]
TrainOpt = Annotated[
    Path | None, typer.Option("--train", help="Training spec (JSON or YAML).", dir_okay=False)
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a training key, e.g. --set offload.mode=optimizer."),
]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU preset name or hardware file.")]
HostOpt = Annotated[
    str | None, typer.Option("--host-memory", help="Host RAM of the node, e.g. 1.5TiB.")
]
NodeOpt = Annotated[
    int | None, typer.Option("--gpus-per-node", min=1, help="GPUs sharing the host RAM.")
]
FormatOpt = Annotated[TextOrJson, typer.Option("--format", help="Output format.")]
MarginOpt = Annotated[
    float | None,
    typer.Option("--margin", min=0, max=100, help="Safety margin, % of the predicted peak."),
]


def _load(
    model: str,
    train: Path | None,
    set_: list[str] | None,
    gpu: str,
    host_memory: str | None,
    gpus_per_node: int | None,
) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware]:
    spec = planner.load_model(model)
    train_spec = planner.load_train(_train_dict(train, set_ or []))
    hw = planner.load_hardware(
        gpu, host_memory=host_memory, gpus_per_node=gpus_per_node, host_memory_field="--host-memory"
    )
    return spec, train_spec, hw


@app.command()
def estimate(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    host_memory: HostOpt = None,
    gpus_per_node: NodeOpt = None,
    format: FormatOpt = TextOrJson.text,
    explain: Annotated[bool, typer.Option("--explain", help="Show each bucket's formula.")] = False,
    calibrated: Annotated[
        bool,
        typer.Option(
            "--calibrated",
            help="Use the fitted coefficients of the spec's activation profile (the store's "
            "active set for this GPU, else its generic one, else the shipped one), with the "
            "trust rule's margin from recent measurements; exit 3 if it has none.",
        ),
    ] = False,
) -> None:
    """Predict per-bucket GPU and host memory, the peak phase, and whether it fits."""
    try:
        spec, train_spec, hw = _load(model, train, set_, gpu, host_memory, gpus_per_node)
        coeffs = None
        if calibrated:
            from headroom.calibration.stored import calibrated_for
            from headroom.store import open_store

            try:
                with open_store()() as session:
                    coeffs = calibrated_for(
                        session=session, profile=train_spec.activation_profile, hw=hw
                    )
            except planner.NotCalibrated as exc:
                raise _fail(str(exc), 3) from None
        budget = planner.estimate(spec, train_spec, hw, coeffs)
        explanations = planner.explain(spec, train_spec, hw) if explain else None
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    if format is TextOrJson.json:
        out = budget.model_dump()
        if explanations is not None:
            out["explain"] = {k: v.model_dump() for k, v in explanations.items()}
        typer.echo(json.dumps(out, indent=2))
        return
    from headroom.render import render_budget, render_explanations

    console = Console()
    render_budget(budget, console)
    if explanations is not None:
        render_explanations(explanations, console)


class GateFormat(StrEnum):
    text = "text"
    json = "json"
    github = "github"
    junit = "junit"


def _junit(verdict: planner.Verdict, model: str, gpu: str) -> str:
    from xml.etree import ElementTree as ET

    name = f"{model} on {gpu}"
    suite = ET.Element(
        "testsuite",
        name="headroom gate",
        tests="1",
        failures="1" if verdict.decision == "oom" else "0",
        errors="1" if verdict.decision == "undecided" else "0",
    )
    case = ET.SubElement(suite, "testcase", classname="headroom.gate", name=name)
    if verdict.decision == "oom":
        ET.SubElement(case, "failure", message=verdict.reason, type="PredictedOOM")
    elif verdict.decision == "undecided":
        ET.SubElement(case, "error", message=verdict.reason, type="Undecided")
    ET.SubElement(case, "system-out").text = verdict.model_dump_json()
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


@app.command()
def gate(
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
        spec, train_spec, hw = _load(model, train, set_, gpu, host_memory, gpus_per_node)
        verdict = planner.gate(planner.estimate(spec, train_spec, hw), margin, require_calibration)
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    gib = 2**30
    summary = (
        f"{verdict.decision}: {spec.name} on {hw.name}: "
        f"peak {verdict.gpu_peak_bytes / gib:.2f} GiB ({verdict.peak_phase}) "
        f"+ margin {verdict.margin_bytes / gib:.2f} GiB of "
        f"{verdict.gpu_capacity_bytes / gib:.2f} GiB; {verdict.reason}"
    )
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
    raise typer.Exit(verdict.exit_code)


class ProbeDevice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def _probe_device(choice: ProbeDevice) -> str:
    if choice is not ProbeDevice.auto:
        if choice is ProbeDevice.cuda:
            import torch

            if not torch.cuda.is_available():
                raise _fail("--probe-device: cuda is not available here; allowed here: cpu, auto")
        return choice.value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


ProbeOpt = Annotated[
    bool,
    typer.Option(
        "--probe",
        help="Confirm the plan by running it into step 2 on the bundled trainer; step down on "
        "out-of-memory.",
    ),
]
ProbeDeviceOpt = Annotated[
    ProbeDevice,
    typer.Option(
        "--probe-device",
        help="Where probes run: cuda, or cpu under a simulated device of the GPU's memory.",
    ),
]
MaxProbesOpt = Annotated[
    int, typer.Option("--max-probes", min=1, max=20, help="Probes before giving up.")
]
RecordOpt = Annotated[
    bool,
    typer.Option("--record/--no-record", help="Store each probe as a calibration record."),
]


def _autofit(
    model: str,
    spec: planner.ModelSpec,
    train_spec: planner.TrainSpec,
    hw: planner.Hardware,
    margin: float | None,
    device: str,
    max_probes: int,
    record: bool,
) -> Any:
    from headroom.launch.ladder import autofit, subprocess_prober

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
            f"grad_accum_steps={p['grad_accum_steps']} recompute={p['recompute']} "
            f"offload={p['offload']} zero_stage={p['parallel']['zero_stage']} "
            f"expandable_segments={p['expandable_segments']}"
        )
        console.print(
            f"predicted: {result.predicted_step_seconds:.3f} s/step, "
            f"{result.predicted_tokens_per_second:,.0f} tokens/s, GPU peak "
            f"{planner.format_bytes(result.budget.gpu.peak_bytes)} "
            f"({result.budget.peak_phase}) of {planner.format_bytes(hw.memory_bytes)}"
        )


@app.command()
def fit(
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
    try:
        spec, train_spec, hw = _load(model, train, set_, gpu, host_memory, gpus_per_node)
        if probe:
            from headroom.runtime.support import check_supported

            check_supported(spec)
            auto = _autofit(
                model,
                spec,
                train_spec,
                hw,
                margin,
                _probe_device(probe_device),
                max_probes,
                record,
            )
            result = auto.fit
        else:
            result = planner.fit(spec, train_spec, hw, margin_pct=margin)
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    fits = auto.fits if probe else result.fits
    if format is TextOrJson.json:
        out = result.model_dump(mode="json")
        if probe:
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
        if probe:
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
                    f"margin {p.margin_pct:g}%, changes {p.changes}"
                )
            console.print(auto.reason)
    raise typer.Exit(0 if fits else 1)


class Backend(StrEnum):
    local = "local"
    torchrun = "torchrun"


#: ``headroom launch`` exit codes beyond 0/1/2/3
EXIT_RUN_FAILED = 4
EXIT_CANCELLED = 130


@app.command()
def launch(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    host_memory: HostOpt = None,
    gpus_per_node: NodeOpt = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 10,
    backend: Annotated[Backend, typer.Option("--backend", help="Launcher backend.")] = (
        Backend.local
    ),
    device: Annotated[
        ProbeDevice,
        typer.Option("--device", help="Where the run (and its probes) train: cuda, cpu, or auto."),
    ] = ProbeDevice.auto,
    fit_plan: Annotated[
        bool,
        typer.Option(
            "--fit/--no-fit",
            help="Let the ladder choose the plan (--no-fit: the spec as given, gated).",
        ),
    ] = True,
    margin: MarginOpt = None,
    probe: ProbeOpt = False,
    max_probes: MaxProbesOpt = 3,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Fit (and optionally probe), then train with the bundled trainer, recorded as a run in the
    store (HEADROOM_DATABASE_URL). Exit 0 succeeded, 1 nothing fits, 2 invalid input, 3 the
    trainer ran out of memory, 4 it failed otherwise, 130 cancelled."""
    from headroom import launch as launching
    from headroom.api.settings import Settings
    from headroom.store import open_store

    try:
        spec, train_spec, hw = _load(model, train, set_, gpu, host_memory, gpus_per_node)
        from headroom.runtime.support import check_supported

        check_supported(spec)
        where = _probe_device(device)
        probes: list[Any] = []
        if probe:
            auto = _autofit(model, spec, train_spec, hw, margin, where, max_probes, True)
            probes = [p.model_dump(mode="json") for p in auto.probes]
            if not auto.fits or auto.plan is None:
                raise _refuse(auto.reason, format, {"probes": probes})
            plan = launching.RunPlan.of_fit(spec, auto.fit, hw, auto.confirmed)
        elif fit_plan:
            try:
                plan = launching.plan_run(
                    model=spec, train=train_spec, hw=hw, fit=True, margin_pct=margin
                )
            except launching.NoPlanFits as exc:
                raise _refuse(exc.reason, format, {}) from None
        else:
            plan = launching.RunPlan.estimated(spec, train_spec, hw)
        sessions = open_store()
        with sessions() as session:
            row, _ = launching.queue_run(
                session=session, plan=plan, steps=steps, backend=backend.value, gate=True
            )
        settings = Settings(run_device=where)
        run = launching.Supervisor(sessions, settings).run_now(row.id, plan)
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    out = {
        "run": {
            "id": run.id,
            "uid": run.uid,
            "status": run.status,
            "backend": run.backend,
            "device": run.device,
            "exit_code": run.exit_code,
            "reason": run.reason,
            "log_path": run.log_path,
        },
        "plan": run.plan["train"],
        "probes": probes,
    }
    if format is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(
            f"run {run.id} ({run.uid}) {run.status}: {run.reason}; log {run.log_path or '-'}"
        )
    if run.status == "succeeded":
        raise typer.Exit(0)
    if run.status == "cancelled":
        raise typer.Exit(EXIT_CANCELLED)
    raise typer.Exit(EXIT_OOM if run.exit_code == EXIT_OOM else EXIT_RUN_FAILED)


def _refuse(reason: str, format: TextOrJson, extra: dict[str, Any]) -> typer.Exit:
    """Nothing fits: exit 1 with the reason (and, in JSON, what was tried)."""
    if format is TextOrJson.json:
        typer.echo(json.dumps({"run": None, "reason": reason, **extra}, indent=2))
    else:
        typer.echo(f"not launched: {reason}", err=True)
    return typer.Exit(1)


@app.command()
def presets(format: FormatOpt = TextOrJson.text) -> None:
    """List the bundled GPU and model presets."""
    gpus = [planner.gpu(name) for name in planner.gpu_names()]
    models = planner.model_names()
    if format is TextOrJson.json:
        payload = {
            "gpus": [hw.model_dump() for hw in gpus],
            "models": [
                {"name": name, "params_total": planner.count_params(planner.load_model(name)).total}
                for name in models
            ],
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.table import Table

    console = Console()
    table = Table(title="GPU presets")
    for column in ("name", "memory", "bf16 TFLOP/s", "host link", "aliases"):
        table.add_column(column)
    for hw in gpus:
        table.add_row(
            hw.name,
            planner.format_bytes(hw.memory_bytes),
            f"{hw.bf16_flops / 1e12:g}",
            f"{hw.host_link} ({hw.host_link_bytes_per_s / 1e9:g} GB/s)",
            ", ".join(hw.aliases),
        )
    console.print(table)
    table = Table(title="Model presets")
    table.add_column("name")
    table.add_column("parameters", justify="right")
    for name in models:
        count = planner.count_params(planner.load_model(name))
        table.add_row(name, f"{count.total:,}")
    console.print(table)


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@app.command()
def train(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 10,
    device: Annotated[Device, typer.Option("--device", help="Where to compute.")] = Device.cpu,
    dtype: Annotated[DType, typer.Option("--dtype", help="Working precision.")] = DType.float32,
    seed: Annotated[int, typer.Option("--seed", help="Weights and data seed.")] = 0,
    reference: Annotated[
        bool, typer.Option("--reference", help="Plain PyTorch AdamW, whatever the placement.")
    ] = False,
    report: Annotated[
        Path | None, typer.Option("--report", help="Write the JSON report here.", dir_okay=False)
    ] = None,
    memory_cap: Annotated[
        str | None,
        typer.Option(
            "--memory-cap",
            help="Device memory to allow, e.g. 48MiB: on CUDA the allocator's per-process "
            "fraction; on a CPU a simulated device that runs out of memory past it.",
        ),
    ] = None,
) -> None:
    """Train with the bundled trainer on synthetic tokens; exit 3 on out-of-memory."""
    try:
        spec = planner.load_model(model)
        train_spec = planner.load_train(_train_dict(train, set_ or []))
        cap_bytes = None if memory_cap is None else parse_size(memory_cap, field="--memory-cap")
        from headroom.runtime.support import (
            WORKING,
            check_memory_holds,
            check_supported,
            runtime_precision,
        )

        check_supported(spec)
        runtime_precision(train_spec, WORKING[dtype.value])
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    import contextlib

    import torch

    from headroom.planner.report import OutOfMemoryAt, TrainerReport
    from headroom.runtime.cap import DeviceCap
    from headroom.runtime.model import kv_layout
    from headroom.runtime.probe import MemoryProbe
    from headroom.runtime.trainer import RunConfig, train_model

    if device is Device.cuda and not torch.cuda.is_available():
        raise _fail("--device: cuda is not available on this machine; allowed here: cpu")
    torch_device = torch.device(device.value)
    total = (
        torch.cuda.get_device_properties(torch_device).total_memory if device is Device.cuda else 0
    )
    try:
        check_memory_holds(spec, total)
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    cap: DeviceCap | None = None
    if cap_bytes is not None and device is Device.cuda:
        if cap_bytes > total:
            raise _fail(f"--memory-cap: {cap_bytes} bytes is more than the device's {total}")
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, torch_device)
    elif cap_bytes is not None:
        cap = DeviceCap(cap_bytes)
    probe = MemoryProbe(torch_device, cap)
    cfg = RunConfig(
        steps=steps,
        device=device.value,
        dtype=getattr(torch, dtype.value),
        seed=seed,
        reference=reference,
    )
    out = TrainerReport(
        model=spec.name, train=train_spec, device=device.value, dtype=dtype.value, seed=seed
    )
    code = 0
    if cap_bytes is not None:
        out.memory_cap_bytes = cap_bytes
    try:
        with cap if cap is not None else contextlib.nullcontext():
            result = train_model(spec, train_spec, cfg, on_phase=probe)
        out.losses = result.losses
        out.steps = result.steps
        out.tokens_per_second = result.tokens_per_second
        out.placement = result.placement
        out.attention_kv = kv_layout(spec, torch_device, cfg.dtype)
    except torch.OutOfMemoryError as exc:
        code = EXIT_OOM
        out.oom = OutOfMemoryAt(**probe.failing_phase(), message=str(exc).splitlines()[0])
    out.memory = probe.report()
    text = json.dumps(out.dump(), indent=2)
    if report is not None:
        report.write_text(text + "\n")
    typer.echo(text)
    if out.oom is not None:
        typer.echo(f"error: out of memory in {out.oom.phase}, step {out.oom.step}", err=True)
    raise typer.Exit(code)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 1,
) -> None:
    """Serve the API and the budget page, after upgrading the database to the latest migration."""
    import os

    import uvicorn

    from headroom.api.settings import Settings
    from headroom.store import upgrade

    settings = Settings()
    if settings.migrate:
        upgrade(settings.database_url)  # once, before any worker starts
    os.environ["HEADROOM_MIGRATE"] = "false"
    uvicorn.run(
        "headroom.api.main:app",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        access_log=False,
    )


calibrate = typer.Typer(
    help="Measure memory and compare it with the estimate, per bucket.", no_args_is_help=True
)
app.add_typer(calibrate, name="calibrate")


class Impl(StrEnum):
    runtime = "runtime"
    hf = "hf"


def _hf_config(model: str) -> dict[str, Any] | None:
    """The raw ``config.json`` dict when MODEL is one (an hf trace builds exactly that)."""
    path = Path(model)
    if not path.is_file():
        return None
    from headroom.planner.io import read_file

    data = read_file(path)
    return dict(data) if isinstance(data, dict) and "model_type" in data else None


@calibrate.command("trace")
def calibrate_trace(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    impl: Annotated[
        Impl, typer.Option("--impl", help="Which implementation of the model to trace.")
    ] = Impl.runtime,
    steps: Annotated[int, typer.Option("--steps", min=1, max=10, help="Optimizer steps.")] = 2,
    record: Annotated[
        bool, typer.Option("--record", help="Store the comparison as a calibration record.")
    ] = False,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Trace training steps on the CPU (fake tensors where shapes allow) with PyTorch's memory
    tracker and print predicted vs traced bytes per bucket and at the peak.

    --impl runtime traces Headroom's trainer; --impl hf a transformers model (the extra
    headroom[hf]) built from MODEL's config.json, or from the spec's shape."""
    config = None
    try:
        spec, train_spec, hw = _load(model, train, set_, gpu, None, None)
        from headroom.calibration.trace import check_traceable

        check_traceable(train_spec)
        if impl is Impl.hf:
            from headroom.calibration import hf

            hf.require_transformers()
            config = _hf_config(model) or hf.config_for(spec)
            hf.spec_of(config)  # one of the architectures it builds
        else:
            from headroom.runtime.support import check_supported

            check_supported(spec)
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    from headroom.calibration.trace import compare_trace, steady_forward_transient, trace

    budget = planner.estimate(spec, train_spec, hw)
    try:
        measured = trace(spec, train_spec, steps=steps, impl=impl.value, config=config)
    except planner.HeadroomError as exc:  # a config transformers cannot build
        raise _fail(str(exc)) from None
    out = {
        "model": spec.name,
        "impl": impl.value,
        "gpu": hw.name,
        **compare_trace(budget, measured),
        "trace": measured,
    }
    if record:
        import uuid

        from headroom.calibration.stored import record_measurement
        from headroom.planner.measurement import Measurement
        from headroom.store import open_store

        peak = measured["peak"]
        uid = f"trace-{uuid.uuid4().hex}"
        with open_store()() as session:
            record_measurement(
                session=session,
                uid=uid,
                model=spec,
                train=train_spec,
                hw=hw,
                budget=budget,
                measured=Measurement(
                    allocated_bytes=max(peak["total"], 1),
                    buckets={
                        "params": peak["params"],
                        "grads": peak["grads"],
                        "optimizer_states": peak["optimizer_states"],
                    },
                    forward_transient_bytes=steady_forward_transient(measured),
                ),
                source="trace",
                notes=f"{impl.value} trace ({measured['mode']} tensors, torch "
                f"{measured['torch']}); transient bytes at the peak: {peak['transient']}",
            )
        out["calibration_uid"] = uid
    if format is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{spec.name}: predicted ({out['phase']}) vs traced peak")
    for column in ("bucket", "predicted", "traced", "error"):
        table.add_column(column, justify="right" if column != "bucket" else "left")
    for bucket, predicted in out["predicted"].items():
        error = out["error"][bucket]
        table.add_row(
            bucket,
            planner.format_bytes(predicted),
            planner.format_bytes(out["measured"][bucket]),
            "n/a" if error is None else f"{error:+.1%}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"traced with {measured['mode']} tensors in {measured['seconds']:.1f} s; "
        f"transient = {' + '.join(out['transient_buckets'])}"
    )


@calibrate.command("run")
def calibrate_run(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    gpu_probe: Annotated[
        bool,
        typer.Option(
            "--gpu-probe",
            help="Run the trainer on this machine's CUDA device under its memory probe (the "
            "only measurement calibrate run makes; a CPU measurement is calibrate trace).",
        ),
    ] = False,
    steps: Annotated[int, typer.Option("--steps", min=2, max=20, help="Optimizer steps.")] = 3,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Run the bundled trainer on the GPU, attribute its memory probe and store the record
    (source ``runtime``) with the estimate it is compared against. Exit 3 on out-of-memory."""
    try:
        spec, train_spec, hw = _load(model, train, set_, gpu, None, None)
        from headroom.runtime.support import check_supported, runtime_train, working_precision

        check_supported(spec)
        # the planner predicts the state the trainer keeps (fp32 weights: fp32 gradients)
        run_spec = runtime_train(train_spec, working_precision(train_spec))
        if not gpu_probe:
            raise planner.SpecError(
                "--gpu-probe: calibrate run measures a GPU run, pass --gpu-probe (on a CPU, "
                "measure with headroom calibrate trace)",
                field="--gpu-probe",
            )
        import torch

        if not torch.cuda.is_available():
            raise planner.SpecError(
                "--gpu-probe: no CUDA device on this machine; measure on the CPU with "
                "headroom calibrate trace",
                field="--gpu-probe",
            )
    except planner.HeadroomError as exc:
        raise _fail(str(exc)) from None
    from headroom.launch.backends import EXIT_OOM
    from headroom.launch.ladder import subprocess_prober
    from headroom.launch.recording import probe_recorder
    from headroom.store import open_store

    budget = planner.estimate(spec, run_spec, hw)
    outcome = subprocess_prober(model, hw, "cuda", steps)(run_spec)
    uid = probe_recorder(open_store(), spec, hw, "runtime")(run_spec, budget, outcome)
    out = {
        "model": spec.name,
        "gpu": hw.name,
        "predicted_peak_bytes": budget.gpu_peak_bytes,
        "predicted_phase": budget.peak_phase,
        "outcome": outcome.model_dump(mode="json"),
        "calibration_uid": uid,
    }
    if format is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
    else:
        measured = outcome.measured_peak_bytes
        Console().print(
            f"{spec.name} on {hw.name}: predicted {planner.format_bytes(budget.gpu_peak_bytes)} "
            f"({budget.peak_phase}), measured "
            f"{'n/a' if measured is None else planner.format_bytes(measured)}"
            f"{' (out of memory)' if outcome.oom else ''}; record {uid or 'none'}"
        )
    if not outcome.ok:
        raise typer.Exit(EXIT_OOM if outcome.oom else 1)


@calibrate.command("fit")
def calibrate_fit(
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile",
            help="Activation profile to refit (repeatable; default: every profile with "
            "committed or stored traces).",
        ),
    ] = None,
    committed: Annotated[
        bool,
        typer.Option(
            "--committed/--no-committed",
            help="Fit the committed traces too, not only the store's records.",
        ),
    ] = True,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Refit coefficient sets from the committed traces and the store's records and store them
    as the active sets (``estimate --calibrated`` uses them); earlier sets stay, inactive."""
    from headroom.calibration.refit import committed_records, refit
    from headroom.store import all_calibrations, open_store, save_coefficient_set

    known = planner.profiles()
    for name in profile or []:
        if name not in known:
            raise _fail(f"--profile: unknown profile {name!r}; allowed: {', '.join(known)}")
    sessions = open_store()
    with sessions() as session:
        rows = all_calibrations(session=session)
    wanted = profile or [
        p
        for p in known
        if (committed and committed_records(p))
        or any(r.source == "trace" and r.activation_profile == p for r in rows)
    ]
    results, skipped = [], []
    for name in wanted:
        try:
            sets, summary = refit(rows, name, committed)
        except planner.SpecError as exc:
            skipped.append({"profile": name, "reason": str(exc)})
            continue
        with sessions() as session:
            summary["stored"] = [
                {
                    "id": save_coefficient_set(session=session, coeffs=c, fitted_from=src).id,
                    "device": c.device,
                }
                for c, src in sets
            ]
        results.append(summary)
    out = {"fitted": results, "skipped": skipped}
    if format is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
    else:
        console = Console()
        for r in results:
            devices = ", ".join(s["device"] or "generic" for s in r["stored"])
            console.print(
                f"[bold]{r['profile']}[/]: fitted from {r['traces']['committed']} committed and "
                f"{r['traces']['stored']} stored trace(s); peak error max "
                f"{r['peak_error']['max']:.2%} (shipped set: "
                f"{r['shipped_peak_error']['max']:.2%}); stored sets: {devices}"
            )
            console.print(
                "  " + ", ".join(f"{k}={v:.4g}" for k, v in r["values"].items()), highlight=False
            )
            for gpu in sorted(r["allocator_overhead"].keys() | r["cuda_context"].keys()):
                parts = []
                if gpu in r["allocator_overhead"]:
                    a = r["allocator_overhead"][gpu]
                    parts.append(f"allocator overhead {a['fraction']:.2%} ({a['records']} runs)")
                if gpu in r["cuda_context"]:
                    c = r["cuda_context"][gpu]
                    parts.append(
                        f"CUDA context {planner.format_bytes(c['bytes'])} ({c['records']} runs)"
                    )
                console.print(f"  {gpu}: " + ", ".join(parts), highlight=False)
        for s in skipped:
            console.print(f"[yellow]{s['profile']}[/]: skipped: {s['reason']}")
    if not results:
        raise typer.Exit(1)


@calibrate.command("report")
def calibrate_report(
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Draw predicted against measured peaks here.", dir_okay=False),
    ] = None,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Per-bucket median, p95 and max error of the estimate over the committed traces and the
    store's calibration records, and the false-fit count."""
    from headroom.calibration.report import committed_points, plot, store_points, summarise
    from headroom.store import all_calibrations, open_store

    with open_store()() as session:
        rows = all_calibrations(session=session)
    points = committed_points() + store_points(rows)
    summary = summarise(points)
    if png is not None:
        plot(points, png)
        summary["png"] = str(png)
    if format is TextOrJson.json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"Estimate error over {summary['points']} measurement(s)")
    for column in ("", "n", "median", "p95", "max", "mean (signed)"):
        table.add_column(column, justify="right" if column else "left")

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2%}"

    for name, s in [("peak", summary["peak"]), *summary["buckets"].items()]:
        table.add_row(
            name,
            str(s["n"]),
            pct(s["median"]),
            pct(s["p95"]),
            pct(s["max"]),
            pct(s.get("signed_mean")),
        )
    console = Console()
    console.print(table)
    console.print(f"false fits (predicted to fit, ran out of memory): {summary['false_fits']}")
    if png is not None:
        console.print(f"plot: {png}")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except planner.HeadroomError as exc:  # pragma: no cover - commands catch their own
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
