"""``headroom launch``: fit (and optionally probe), then train, recorded as a run in the store.

The store, the supervisor and the trainer's checks are imported inside the command: they need
the service's and the runtime's packages, which ``pip install headroom-planner`` leaves out.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

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
from headroom.cli.progress import Follower
from headroom.cli.render import offload_text, recompute_text

if TYPE_CHECKING:
    from pydantic import BaseModel

    from headroom.launch import RunPlan
    from headroom.launch.k8s import K8sSettings


class Backend(StrEnum):
    local = "local"
    torchrun = "torchrun"
    slurm = "slurm"
    k8s = "k8s"


def _summary(run: Any, plan: Any) -> dict[str, Any]:
    """What a launch ends with: the plan it trained, the predicted GPU peak against the measured
    one, throughput and the final loss (None where the trainer wrote no report)."""
    from headroom.launch.supervisor import report_of

    report = report_of(run) if run.log_path else None
    memory = report.memory if report is not None else None
    measured_on = None
    if memory is not None and memory.available:
        measured_on = "device"
    elif memory is not None and memory.simulated is not None:
        measured_on = "simulated device"
    train = plan.train
    predicted = plan.predicted()
    return {
        "plan": {
            "micro_batch_size": train.micro_batch_size,
            "grad_accum_steps": train.grad_accum_steps,
            "recompute": train.recompute,
            "offload": train.offload.mode,
            "parallel": train.parallel.model_dump(),
            # the profile the prediction priced its activations with (the bundled trainer's
            # own, runtime, unless the spec named another)
            "activation_profile": train.activation_profile,
        },
        "predicted_gpu_peak_bytes": predicted.gpu_peak_bytes,
        # like with like: the trainer measures allocated bytes (torch.cuda's, or the simulated
        # device's), not the context and allocator slack of the whole-GPU figure
        "predicted_allocated_peak_bytes": predicted.allocated_peak_bytes,
        "predicted_peak_phase": predicted.peak_phase,
        "measured_gpu_peak_bytes": None if memory is None else memory.measured_peak_bytes,
        "measured_on": measured_on,
        "completed_steps": None if report is None else report.completed_steps,
        "tokens_per_second": None if report is None else report.tokens_per_second,
        "final_loss": report.losses[-1] if report is not None and report.losses else None,
    }


def _summary_text(summary: dict[str, Any]) -> str:
    from headroom import planner

    p = summary["plan"]
    par = p["parallel"]
    lines = [
        f"plan: micro-batch {p['micro_batch_size']} x {p['grad_accum_steps']} accumulated, "
        f"recompute {recompute_text(p['recompute'])}, offload {offload_text(p['offload'])}, "
        f"dp {par['dp']} "
        f"(ZeRO {par['zero_stage']}), tp {par['tp']}, pp {par['pp']}",
    ]
    allocated = planner.format_bytes(summary["predicted_allocated_peak_bytes"])
    peak = (
        f"allocated peak predicted {allocated}"
        f" ({summary['predicted_peak_phase']}, {p['activation_profile']} profile; the whole GPU "
        f"{planner.format_bytes(summary['predicted_gpu_peak_bytes'])})"
    )
    if summary["measured_gpu_peak_bytes"] is not None:
        peak += (
            f", measured {planner.format_bytes(summary['measured_gpu_peak_bytes'])} "
            f"on the {summary['measured_on']}"
        )
    else:
        peak += ", not measured (no CUDA device and no simulated cap)"
    lines.append(peak)
    if summary["completed_steps"] is not None:
        rate = summary["tokens_per_second"]
        loss = summary["final_loss"]
        lines.append(
            f"{summary['completed_steps']} step(s)"
            + (f", {rate:,.0f} tokens/s" if rate is not None else "")
            + (f", final loss {loss:.4f}" if loss is not None else "")
        )
    return "\n".join(lines)


def _refuse(reason: str, format: TextOrJson, extra: dict[str, Any]) -> typer.Exit:
    """Nothing fits: exit 1 with the reason (and, in JSON, what was tried)."""
    if format is TextOrJson.json:
        typer.echo(json.dumps({"run": None, "reason": reason, **extra}, indent=2))
    else:
        typer.echo(f"not launched: {reason}", err=True)
    return typer.Exit(ExitCode.NOTHING_FITS)


M = TypeVar("M", bound="BaseModel")


def _per_launch(
    backend: Backend, wanted: Backend, model: type[M], given: dict[str, Any]
) -> M | None:
    """A cluster backend's shape for this launch from its ``--<backend>-*`` options (``given``:
    field -> value, None where not given; a node count of 1 is the default), as ``model``
    (None: another backend); a SpecError names the option that is invalid, or given without
    ``--backend <wanted>``."""
    from pydantic import ValidationError

    from headroom.planner import SpecError

    chosen = {k: v for k, v in given.items() if v is not None and (k, v) != ("nodes", 1)}
    if backend is not wanted:
        if chosen:
            name = f"--{wanted.value}-{next(iter(chosen)).replace('_', '-')}"
            raise SpecError(
                f"{name}: needs --backend {wanted.value} (got {backend.value})", field=name[2:]
            )
        return None
    try:
        return model.model_validate(chosen)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = f"--{wanted.value}-{str(first['loc'][0]).replace('_', '-')}"
        raise SpecError(f"{name}: {first['msg']}", field=name[2:]) from None


def _dry_run(backend: Backend, dry_run: bool, probe: bool) -> None:
    """Refuse (a SpecError naming the option) what a dry run cannot be: a k8s run is rendered,
    never submitted, and only a k8s run is rendered; probes would train on this host, not on
    the cluster's nodes."""
    from headroom.planner import SpecError

    if backend is Backend.k8s and not dry_run:
        raise SpecError(
            "--dry-run: k8s runs are rendered, not submitted: add --dry-run to print the "
            "PyTorchJob manifest, then kubectl apply -f it",
            field="dry-run",
        )
    if dry_run and backend is not Backend.k8s:
        raise SpecError(
            f"--dry-run: only a k8s run is rendered (--backend k8s); got --backend {backend.value}",
            field="dry-run",
        )
    if dry_run and probe:
        raise SpecError(
            "--probe: probes train on this host, not on the cluster's nodes; leave it out of a "
            "--dry-run",
            field="probe",
        )


def _k8s_device(device: ProbeDevice, gpus_per_node: int) -> str:
    """Where a k8s job's pods train: ``auto`` is their GPUs if they are given any; ``cuda``
    needs some."""
    from headroom.planner import SpecError

    if device is ProbeDevice.auto:
        return "cuda" if gpus_per_node else "cpu"
    if device is ProbeDevice.cuda and not gpus_per_node:
        raise SpecError(
            "--device: cuda needs GPUs in the pods (--k8s-gpus-per-node or "
            "HEADROOM_K8S_GPUS_PER_NODE, now 0); allowed: cpu, auto",
            field="device",
        )
    return device.value


def _print_manifests(
    plan: RunPlan, steps: int, device: str, shape: tuple[K8sSettings, int], format: TextOrJson
) -> None:
    """Print the run as its ConfigMap and PyTorchJob (YAML; in JSON a ``v1`` List), once the
    plan passes what a queued run would."""
    import uuid

    from headroom.launch import k8s
    from headroom.launch.plan import check_launchable
    from headroom.launch.settings import ranks_per_node

    check_launchable(plan, gate=True)
    settings, nodes = shape
    # the trainer's data-parallel ranks over the pods
    ranks = ranks_per_node(plan.train.parallel.dp, nodes)
    settings = settings.model_copy(update={"ranks_per_node": ranks})
    documents = k8s.manifests(
        plan, uid=uuid.uuid4().hex, steps=steps, device=device, nodes=nodes, settings=settings
    )
    if format is TextOrJson.json:
        typer.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}, indent=2))
    else:
        typer.echo(k8s.render_yaml(documents), nl=False)


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
    k8s_image: Annotated[
        str | None, typer.Option("--k8s-image", help="--backend k8s: the container image.")
    ] = None,
    k8s_namespace: Annotated[
        str | None, typer.Option("--k8s-namespace", help="--backend k8s: metadata.namespace.")
    ] = None,
    k8s_gpus_per_node: Annotated[
        int | None,
        typer.Option("--k8s-gpus-per-node", help="--backend k8s: GPUs per pod.", min=0),
    ] = None,
    k8s_nodes: Annotated[
        int, typer.Option("--k8s-nodes", help="--backend k8s: pods (nodes) the job runs on.", min=1)
    ] = 1,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="--backend k8s: print the PyTorchJob manifest (YAML); nothing is run or stored.",
        ),
    ] = False,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Fit (and optionally probe), then train with the bundled trainer, recorded as a run in the
    store (HEADROOM_DATABASE_URL). Exit 0 succeeded, 1 nothing fits, 2 invalid input, 3 the
    trainer ran out of memory, 4 it failed otherwise, 130 cancelled. With --backend slurm the
    run is a batch job (HEADROOM_SLURM_* settings, --slurm-* over them), watched until it
    ends; with --probe it probes on its node before it trains. With --backend k8s --dry-run
    the run is printed as a Kubeflow PyTorchJob manifest (HEADROOM_K8S_* settings, --k8s-*
    over them) for kubectl apply -f; nothing is stored."""
    from headroom import launch as launching
    from headroom.launch.supervisor import NOT_CONFIRMED

    with user_errors():
        _dry_run(backend, dry_run, probe)
        spec, train_spec, hw = load_specs(model, train, set_, gpu, host_memory, gpus_per_node)
        from headroom.planner.trainable import check_supported, trainer_profile

        check_supported(spec)
        train_spec = trainer_profile(train_spec)  # the bundled trainer's own profile
        from headroom.launch.k8s import K8sOverrides, K8sSettings
        from headroom.launch.settings import from_environment
        from headroom.launch.slurm import SlurmOverrides, SlurmSettings

        allocation = _per_launch(
            backend,
            Backend.slurm,
            SlurmOverrides,
            {
                "partition": slurm_partition,
                "account": slurm_account,
                "time_limit": slurm_time_limit,
                "gpus_per_node": slurm_gpus_per_node,
                "nodes": slurm_nodes,
            },
        )
        shape = _per_launch(
            backend,
            Backend.k8s,
            K8sOverrides,
            {
                "image": k8s_image,
                "namespace": k8s_namespace,
                "gpus_per_node": k8s_gpus_per_node,
                "nodes": k8s_nodes,
            },
        )
        slurm = allocation.model_dump(exclude_none=True) if allocation is not None else None
        k8s = None
        if shape is not None:
            k8s = shape.applied(from_environment(K8sSettings)), shape.nodes
            where = _k8s_device(device, k8s[0].gpus_per_node)
        elif allocation is not None and device is ProbeDevice.auto:
            # where the job's nodes train: their GPUs if the allocation has any
            given = allocation.applied(from_environment(SlurmSettings))
            where = "cuda" if given.gpus_per_node else "cpu"
        else:
            where = resolve_device(device)
        probes: list[Any] = []
        # a Slurm job probes on its node, before its trainer, not here (the supervisor submits
        # it so); other runs train here, where their probes run
        in_job = probe and backend is Backend.slurm
        if probe and not in_job:
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
        if k8s is not None:
            _print_manifests(plan, steps, where, k8s, format)
            raise typer.Exit(ExitCode.OK)
        from headroom.launch.rundirs import run_dir
        from headroom.launch.supervisor import PROGRESS
        from headroom.store import open_store

        sessions = open_store()
        settings = launching.LaunchSettings(run_device=where)
        with sessions() as session:
            row, _ = launching.queue_run(
                session=session,
                plan=plan,
                steps=steps,
                backend=backend.value,
                gate=True,
                probe=in_job,
                slurm=slurm,
            )
            row_id, directory = row.id, run_dir(settings, row)
        # the trainer's line per step, shown while the run goes (kept for --format json)
        show = "none" if format is TextOrJson.json else "bar" if sys.stderr.isatty() else "lines"
        with Follower(directory / PROGRESS, show) as follower:
            run = launching.Supervisor(sessions, settings).run_now(row_id, plan)
        progress = follower.lines
    summary = _summary(run, plan)
    out = {
        "summary": summary,
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
        "probes": probes or run.plan.get("probes", []),
        "progress": progress,
    }
    if format is TextOrJson.json:
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(
            f"run {run.id} ({run.uid}) {run.status}: {run.reason}; log {run.log_path or '-'}"
        )
        typer.echo(_summary_text(summary))
    if run.status == "succeeded":
        raise typer.Exit(ExitCode.OK)
    if run.status == "cancelled":
        raise typer.Exit(ExitCode.CANCELLED)
    if run.reason.startswith(NOT_CONFIRMED):  # the job's probes confirmed no plan
        raise typer.Exit(ExitCode.NOTHING_FITS)
    # the trainer's own exit code says whether the device ran out of memory
    if run.exit_code == ExitCode.OUT_OF_MEMORY:
        raise typer.Exit(ExitCode.OUT_OF_MEMORY)
    raise typer.Exit(ExitCode.RUN_FAILED)
