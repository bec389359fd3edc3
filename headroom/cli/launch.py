"""``headroom launch``: fit (and optionally probe), then train, recorded as a run in the store.

The store, the supervisor and the trainer's checks are imported inside the command: they need
the service's and the runtime's packages, which ``pip install headroom`` leaves out.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import typer

from headroom.cli.exits import ExitCode, user_errors
from headroom.cli.fit import resolve_device, run_autofit
from headroom.cli.options import (
    FormatOpt,
    GpuOpt,
    HostOpt,
    MarginOpt,
    MaxProbesOpt,
    ModelArg,
    NodeOpt,
    ProbeDevice,
    ProbeOpt,
    SetOpt,
    TextOrJson,
    TrainOpt,
    load_specs,
)


class Backend(StrEnum):
    local = "local"
    torchrun = "torchrun"
    slurm = "slurm"


def _refuse(reason: str, format: TextOrJson, extra: dict[str, Any]) -> typer.Exit:
    """Nothing fits: exit 1 with the reason (and, in JSON, what was tried)."""
    if format is TextOrJson.json:
        typer.echo(json.dumps({"run": None, "reason": reason, **extra}, indent=2))
    else:
        typer.echo(f"not launched: {reason}", err=True)
    return typer.Exit(ExitCode.NOTHING_FITS)


def _slurm_allocation(
    backend: Backend,
    partition: str | None,
    account: str | None,
    time_limit: str | None,
    gpus_per_node: int | None,
    nodes: int,
) -> dict[str, Any] | None:
    """The run's own Slurm allocation (None: not a Slurm run); a SpecError names the option
    that is invalid, or given without ``--backend slurm``."""
    from pydantic import ValidationError

    from headroom.launch.slurm import SlurmOverrides
    from headroom.planner import SpecError

    given = {
        "partition": partition,
        "account": account,
        "time_limit": time_limit,
        "gpus_per_node": gpus_per_node,
        "nodes": nodes if nodes != 1 else None,
    }
    chosen = {k: v for k, v in given.items() if v is not None}
    if backend is not Backend.slurm:
        if chosen:
            name = next(iter(chosen)).replace("_", "-")
            raise SpecError(
                f"--slurm-{name}: a Slurm allocation needs --backend slurm (got {backend.value})",
                field=f"slurm-{name}",
            )
        return None
    try:
        return SlurmOverrides.model_validate(chosen).model_dump(exclude_none=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]).replace("_", "-")
        raise SpecError(f"--slurm-{name}: {first['msg']}", field=f"slurm-{name}") from None


def launch_command(
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
    slurm_partition: Annotated[
        str | None, typer.Option("--slurm-partition", help="--backend slurm: sbatch --partition.")
    ] = None,
    slurm_account: Annotated[
        str | None, typer.Option("--slurm-account", help="--backend slurm: sbatch --account.")
    ] = None,
    slurm_time_limit: Annotated[
        str | None, typer.Option("--slurm-time-limit", help="--backend slurm: sbatch --time.")
    ] = None,
    slurm_gpus_per_node: Annotated[
        int | None,
        typer.Option("--slurm-gpus-per-node", help="--backend slurm: GPUs per node.", min=0),
    ] = None,
    slurm_nodes: Annotated[
        int, typer.Option("--slurm-nodes", help="--backend slurm: nodes the job runs on.", min=1)
    ] = 1,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Fit (and optionally probe), then train with the bundled trainer, recorded as a run in the
    store (HEADROOM_DATABASE_URL). Exit 0 succeeded, 1 nothing fits, 2 invalid input, 3 the
    trainer ran out of memory, 4 it failed otherwise, 130 cancelled. With --backend slurm the
    run is a batch job (HEADROOM_SLURM_* settings, --slurm-* over them), watched until it
    ends."""
    from headroom import launch as launching
    from headroom.store import open_store

    with user_errors():
        spec, train_spec, hw = load_specs(model, train, set_, gpu, host_memory, gpus_per_node)
        from headroom.planner.trainable import check_supported

        check_supported(spec)
        slurm = _slurm_allocation(
            backend, slurm_partition, slurm_account, slurm_time_limit, slurm_gpus_per_node,
            slurm_nodes,
        )  # fmt: skip
        if slurm is not None and device is ProbeDevice.auto:
            # where the job's nodes train: their GPUs if the allocation has any
            from headroom.launch.slurm import SlurmOverrides, SlurmSettings

            given = SlurmOverrides.model_validate(slurm).applied(SlurmSettings())
            where = "cuda" if given.gpus_per_node else "cpu"
        else:
            where = resolve_device(device)
        probes: list[Any] = []
        if probe:
            auto = run_autofit(model, spec, train_spec, hw, margin, where, max_probes, True)
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
                session=session,
                plan=plan,
                steps=steps,
                backend=backend.value,
                gate=True,
                slurm=slurm,
            )
        settings = launching.LaunchSettings(run_device=where)
        run = launching.Supervisor(sessions, settings).run_now(row.id, plan)
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
            "job_id": run.job_id,
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
        raise typer.Exit(ExitCode.OK)
    if run.status == "cancelled":
        raise typer.Exit(ExitCode.CANCELLED)
    # the trainer's own exit code says whether the device ran out of memory
    if run.exit_code == ExitCode.OUT_OF_MEMORY:
        raise typer.Exit(ExitCode.OUT_OF_MEMORY)
    raise typer.Exit(ExitCode.RUN_FAILED)
