"""``headroom estimate``: per-bucket GPU and host memory, the peak phase, and whether it fits."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from headroom import planner
from headroom.cli.exits import ExitCode, user_errors
from headroom.cli.options import (
    FormatOpt,
    GpuOpt,
    HostOpt,
    ModelArg,
    NodeOpt,
    SetOpt,
    TextOrJson,
    TrainOpt,
    load_specs,
    stored_coefficients,
)


def estimate_command(
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
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Also show the configuration under every framework "
            f"({', '.join(planner.FRAMEWORKS)}) and model code (activation profile: "
            f"{', '.join(planner.profiles())}) side by side.",
        ),
    ] = False,
    step: Annotated[
        bool,
        typer.Option(
            "--step",
            help="Also price the spec's step as given (its layout fixed, fit or not): step "
            "time term by term, tokens/s and MFU, with the links of the GPU's cluster preset "
            "(or --cluster).",
        ),
    ] = False,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="With --step: the cluster preset or file whose links price the collectives "
            "(default: the preset of the GPU's nodes).",
        ),
    ] = None,
) -> None:
    """Predict per-bucket GPU and host memory, the peak phase, and whether it fits."""
    with user_errors():
        spec, train_spec, hw = load_specs(model, train, set_, gpu, host_memory, gpus_per_node)
        coeffs = None
        if calibrated:
            with user_errors(ExitCode.UNDECIDED, (planner.NotCalibrated,)):
                coeffs = stored_coefficients(train_spec, hw)
        budget = planner.estimate(spec, train_spec, hw, coeffs)
        explanations = planner.explain(spec, train_spec, hw) if explain else None
        compared = planner.compare(spec, train_spec, hw) if compare else None
        priced = _price(spec, train_spec, hw, cluster, gpus_per_node, coeffs) if step else None
    if format is TextOrJson.json:
        out = budget.model_dump()
        if explanations is not None:
            out["explain"] = {k: v.model_dump() for k, v in explanations.items()}
        if compared is not None:
            out["compare"] = [c.model_dump() for c in compared]
        if priced is not None:
            out["step"] = priced.model_dump()
        typer.echo(json.dumps(out, indent=2))
        return
    from headroom.cli.render import render_budget, render_comparison, render_explanations
    from headroom.planner.estimator import stage_peaks

    console = Console()
    stages = stage_peaks(spec, train_spec, hw, coeffs) if train_spec.parallel.pp > 1 else ()
    render_budget(budget, console, stages, train_spec)
    if explanations is not None:
        render_explanations(explanations, console)
    if compared is not None:
        render_comparison(compared, console)
    if priced is not None:
        render_step(priced, console)


def _price(
    spec: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    cluster: str | None,
    gpus_per_node: int | None,
    coeffs: planner.Coefficients | None,
) -> planner.StepPrice:
    """The spec's step as given, on ``cluster`` (else the GPU's preset cluster)."""
    from headroom.planner.cluster import cluster_and_gpu, load_cluster

    given = load_cluster(cluster) if cluster is not None else None
    cl, hardware = cluster_and_gpu(given, hw, gpus_per_node)
    return planner.price_spec(spec, train, cl, hardware, coeffs)


def render_step(priced: planner.StepPrice, console: Console) -> None:
    """The step's terms and what they add up to."""
    from rich.table import Table

    table = Table("term", "seconds", "formula", title="Step time, the spec as given")
    for t in priced.terms:
        table.add_row(t.term, f"{t.seconds:.4f}", t.formula)
    console.print(table)
    console.print(
        f"step {priced.step_seconds:.3f} s for {priced.global_batch:,} sequences on "
        f"{priced.gpus:,} GPUs ({priced.cluster}): {priced.tokens_per_second:,.0f} tokens/s, "
        f"MFU {100 * priced.mfu:.1f} %"
    )
