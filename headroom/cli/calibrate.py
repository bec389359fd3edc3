"""``headroom calibrate``: measure memory, compare it with the estimate, refit the coefficients.

``trace`` traces training steps on the CPU, ``run`` measures the trainer on a GPU, ``fit`` refits
the coefficient sets from the traces, ``report`` summarises the estimate's error. torch, numpy,
matplotlib and the store are imported inside the commands that use them.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from headroom import planner
from headroom.cli.exits import ExitCode, fail, user_errors, writable, writing
from headroom.cli.options import (
    FormatOpt,
    GpuOpt,
    ModelArg,
    SetOpt,
    TextOrJson,
    TrainOpt,
    load_specs,
)
from headroom.planner.io import read_file

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from headroom.store import Calibration

calibrate_app = typer.Typer(
    help="Measure memory and compare it with the estimate, per bucket.", no_args_is_help=True
)


def _calibration_rows(sessions: sessionmaker[Session]) -> list[Calibration]:
    """Every calibration record in the store, oldest first."""
    from headroom.store import all_calibrations

    with sessions() as session:
        return all_calibrations(session=session)


class Impl(StrEnum):
    runtime = "runtime"
    hf = "hf"
    torchtitan = "torchtitan"
    megatron = "megatron"
    torchtune = "torchtune"


def _hf_config(model: str) -> dict[str, Any] | None:
    """The raw ``config.json`` dict when MODEL is one (an hf trace builds exactly that)."""
    path = Path(model)
    if not path.is_file():
        return None
    data = read_file(path)
    return dict(data) if isinstance(data, dict) and "model_type" in data else None


@calibrate_app.command("trace")
def trace_command(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    impl: Annotated[
        Impl | None,
        typer.Option(
            "--impl",
            help="Which implementation of the model to trace: runtime, hf, torchtitan, megatron "
            "or torchtune (default: runtime; hf under a framework).",
        ),
    ] = None,
    framework: Annotated[
        str,
        typer.Option(
            "--framework",
            help="The framework the step runs under: none (one rank, plain step) or fsdp2 "
            "(FSDP2 as torchtitan runs it, rank 0 of parallel.dp x parallel.tp on a fake "
            "process group; --impl hf, or torchtitan: its own model under its own "
            "parallelize_llama, data parallel only).",
        ),
    ] = "none",
    steps: Annotated[int, typer.Option("--steps", min=1, max=10, help="Optimizer steps.")] = 2,
    record: Annotated[
        bool, typer.Option("--record", help="Store the comparison as a calibration record.")
    ] = False,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Trace training steps on the CPU (fake tensors where shapes allow) with PyTorch's memory
    tracker and print predicted vs traced bytes per bucket and at the peak.

    --impl runtime traces Headroom's trainer; --impl hf a transformers model (the extra
    headroom-planner[hf]) built from MODEL's config.json, or from the spec's shape; --impl
    torchtitan torchtitan's own Llama 3 model code of the spec's shape (make install adds
    torchtitan); --impl megatron Megatron-Core's GPT with its local layers (make install adds
    megatron-core); --impl torchtune torchtune's Llama 3.2 decoder code (make install adds
    torchtune and torchao).
    --framework fsdp2 traces the hf model under FSDP2 (torchtitan's default run:
    parallel.zero_stage 3, fp32 master and optimizer states, precision.params the compute
    dtype, precision.grads the reduce dtype; tensor parallelism with parallel.tp and
    parallel.sequence_parallel) and prints each phase's peak too."""
    from headroom.calibration.frameworks import check_framework

    config = None
    with user_errors():
        chosen = impl or (Impl.runtime if framework == "none" else Impl.hf)
        check_framework(framework, chosen.value)
        if record and framework != "none":
            raise planner.SpecError(
                f"--record: the store keeps traces of one rank; allowed with --framework none "
                f"(got {framework})",
                field="--record",
            )
        spec, train_spec, hw = load_specs(model, train, set_, gpu, None, None)
        if train_spec.framework not in ("none", framework):
            raise planner.SpecError(
                f"--framework: the training spec says framework {train_spec.framework}; "
                f"allowed: {train_spec.framework} (got {framework})",
                field="--framework",
            )
        # the estimate compared is the framework's
        train_spec = train_spec.model_copy(update={"framework": framework})
        if framework == "fsdp2":
            from headroom.calibration.frameworks import fsdp2

            fsdp2.check_traceable(train_spec)
        else:
            from headroom.calibration.tracing import check_traceable

            check_traceable(train_spec, chosen.value)
        if chosen is Impl.hf:
            from headroom.calibration import hf

            hf.require_transformers()
            config = _hf_config(model) or hf.config_for(spec)
            hf.spec_of(config)  # one of the architectures it builds
            if framework == "fsdp2":
                fsdp2.check_model(config, train_spec)
        elif chosen is Impl.megatron:
            from headroom.calibration import megatron

            megatron.require_megatron()
            megatron.check_model(spec)  # Megatron-Core's local layers, or the field they lack
        elif chosen is Impl.torchtune:
            from headroom.calibration import torchtune

            torchtune.require_torchtune()
            torchtune.check_model(spec)  # Llama 3.2's shape, or the field it lacks
        elif chosen is Impl.torchtitan:
            from headroom.calibration import torchtitan

            # Llama 3's shape, or the field it lacks
            config = torchtitan.config_for(spec, train_spec.seq_len)
        else:
            from headroom.planner.trainable import check_supported

            check_supported(spec)
    from headroom.calibration.comparison import compare_trace
    from headroom.calibration.tracing import steady_forward_transient, trace

    budget = planner.estimate(spec, train_spec, hw)
    with user_errors():  # a config transformers cannot build
        if framework == "fsdp2":
            measured = fsdp2.trace(
                spec,
                train_spec,
                steps=steps,
                config=config,
                impl=chosen.value,
            )
        else:
            measured = trace(spec, train_spec, steps=steps, impl=chosen.value, config=config)
    out = {
        "model": spec.name,
        "impl": chosen.value,
        "framework": framework,
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
                notes=f"{chosen.value} trace ({measured['mode']} tensors, torch "
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
    if framework != "none":
        console.print(
            f"{framework}, rank 0 of {train_spec.parallel.dp * train_spec.parallel.tp}: traced "
            f"peak in {measured['peak_phase']}; per phase "
            + ", ".join(
                f"{name} {planner.format_bytes(p['total'])}"
                for name, p in measured["phases"].items()
            ),
            highlight=False,
        )


@calibrate_app.command("run")
def run_command(
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
    with user_errors():
        spec, train_spec, hw = load_specs(model, train, set_, gpu, None, None)
        from headroom.planner.trainable import check_supported, runtime_train, working_precision

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
    from headroom.launch.probing import subprocess_prober
    from headroom.launch.recording import probe_recorder
    from headroom.store import open_store

    budget = planner.estimate(spec, run_spec, hw)
    outcome = subprocess_prober(model, hw, "cuda", steps)(run_spec, budget)
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
        raise typer.Exit(ExitCode.OUT_OF_MEMORY if outcome.oom else ExitCode.NOTHING_FITS)


class LogFormat(StrEnum):
    megatron = "megatron"
    torchtitan = "torchtitan"
    deepspeed = "deepspeed"
    hf_trainer = "hf_trainer"
    accelerate = "accelerate"
    nvidia_smi = "nvidia_smi"
    memory_snapshot = "memory_snapshot"
    published = "published"


class Stage(StrEnum):
    first = "first"
    last = "last"


@calibrate_app.command("ingest")
def ingest_command(
    logs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="GPU runs' logs: Megatron-LM, torchtitan, DeepSpeed, HF Trainer, Accelerate, "
            "nvidia-smi CSV, a torch.cuda memory snapshot pickle, or the published runs' file.",
            dir_okay=False,
        ),
    ] = None,
    published: Annotated[
        bool,
        typer.Option(
            "--published",
            help="Also read the shipped published GPU runs (calibration/data/"
            "published-memory.json), each a record of the GPU it ran on.",
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="The run's model: preset name, model JSON/YAML, or "
            "config.json (not for the published runs' file).",
        ),
    ] = None,
    train: TrainOpt = None,
    set_: SetOpt = None,
    gpu: GpuOpt = "H100-80GB",
    log_format: Annotated[
        LogFormat | None,
        typer.Option(
            "--format", help="The logs' format (default: recognised from each log's content)."
        ),
    ] = None,
    stage: Annotated[
        Stage | None,
        typer.Option(
            "--stage",
            help="The pipeline stage whose rank logged (default: the "
            "heaviest; Megatron-LM logs every stage's rank, torchtitan rank 0's).",
        ),
    ] = None,
    output: Annotated[TextOrJson, typer.Option("--output", help="Output format.")] = (
        TextOrJson.text
    ),
) -> None:
    """Read GPU runs' logs into calibration records of the stack they ran on (GPU, framework,
    activation profile), each compared with the estimate like with like, and show that
    stack's trust. Every log is read before anything is stored: one that cannot be read is
    refused (exit 2) naming its file and line, and nothing is stored."""
    from headroom.calibration.ingest import read_logs, stacks_trust, store_items
    from headroom.calibration.logs import read_path_bytes

    with user_errors():
        files = [(str(path), read_path_bytes(path)) for path in logs or []]
        if published:
            from headroom.calibration.published import published_file

            files.append(("published-memory.json", published_file()))
        specs: tuple[Any, ...] = (None, None, None)
        if model is not None:
            specs = load_specs(model, train, set_, gpu, None, None)
        ingest = read_logs(
            files,
            fmt=log_format.value if log_format else None,
            model=specs[0],
            train=specs[1],
            hw=specs[2],
            stage=stage.value if stage else None,
        )
    from headroom.store import open_store

    sessions = open_store()
    with sessions() as session, user_errors():
        records = store_items(session, ingest)
        trust = stacks_trust(session, records)
    out = {"records": records, "skipped": list(ingest.skipped), "trust": trust}
    if output is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console(soft_wrap=True)
    for r in records:
        console.print(
            f"{r['name']} ({r['format']}): {r['figure']} measured "
            f"{planner.format_bytes(r['measured_bytes'])}, predicted "
            f"{planner.format_bytes(r['predicted_bytes'])} ({r['relative_error']:+.1%}) for "
            f"{r['model']} on {r['gpu']}; record {r['uid']}"
            f"{'' if r['created'] else ' (already stored)'}",
            highlight=False,
        )
    if ingest.skipped:
        console.print(f"{len(ingest.skipped)} run(s) without a measured number not recorded")
    from headroom.calibration.stored import trust_line

    for t in trust:
        console.print(f"trust: {trust_line(t)}", highlight=False)


@calibrate_app.command("fit")
def fit_command(
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
    from headroom.calibration.refit import committed_records, refit_profile
    from headroom.store import open_store, save_coefficient_set

    known = planner.profiles()
    for name in profile or []:
        if name not in known:
            raise fail(f"--profile: unknown profile {name!r}; allowed: {', '.join(known)}")
    sessions = open_store()
    rows = _calibration_rows(sessions)
    wanted = profile or [
        p
        for p in known
        if (committed and committed_records(p))
        or any(r.source == "trace" and r.activation_profile == p for r in rows)
    ]
    results, skipped = [], []
    for name in wanted:
        try:
            sets, summary = refit_profile(rows, name, committed)
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
        raise typer.Exit(ExitCode.NOTHING_FITS)


@calibrate_app.command("report")
def report_command(
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Draw predicted against measured peaks here.", dir_okay=False),
    ] = None,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Per-bucket median, p95 and max error of the estimate over the committed traces and the
    store's calibration records, and the false-fit count."""
    from headroom.calibration.report import committed_points, plot, store_points, summarise
    from headroom.calibration.stored import stack_trust, stacks, trust_line
    from headroom.store import open_store

    if png is not None:
        writable("--png", png)
    sessions = open_store()
    points = committed_points() + store_points(_calibration_rows(sessions))
    summary = summarise(points)
    with sessions() as session:
        summary["trust"] = stack_trust(session, stacks(session=session))
    if png is not None:
        with writing("--png", png):
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
    pairs = Table(title="The peak's error per (implementation, framework)")
    for column in ("implementation / framework", "n", "median", "p95", "max", "mean (signed)"):
        pairs.add_column(column, justify="left" if column.startswith("impl") else "right")
    for pair, s in summary["by_pair"].items():
        pairs.add_row(
            pair,
            str(s["n"]),
            pct(s["median"]),
            pct(s["p95"]),
            pct(s["max"]),
            pct(s.get("signed_mean")),
        )
    console.print(pairs)
    console.print(f"false fits (predicted to fit, ran out of memory): {summary['false_fits']}")
    for entry in summary["trust"]:
        console.print(f"trust: {trust_line(entry)}", highlight=False, soft_wrap=True)
    if not summary["trust"]:
        console.print("trust: no stored records; every stack keeps the default margin")
    if png is not None:
        console.print(f"plot: {png}")
