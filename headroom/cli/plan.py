"""``headroom plan``: the fastest parallel layout of N GPUs that fits (``planner.plan``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from headroom import planner
from headroom.cli.exits import ExitCode, user_errors
from headroom.cli.options import (
    FormatOpt,
    MarginOpt,
    ModelArg,
    SetOpt,
    TextOrJson,
    TrainOpt,
    train_dict,
)
from headroom.cli.render import offload_text, recompute_text
from headroom.planner.cluster import cluster_and_gpu, load_cluster
from headroom.planner.constraints import split_plan_train
from headroom.planner.hardware import MAX_GPUS_PER_NODE
from headroom.planner.layout import (
    MAX_PLAN_GPUS,
    NEAR_CAPACITY_PCT,
    TIE_BAND_PCT,
    PlanCandidate,
    PlanResult,
)

GpusOpt = Annotated[
    int,
    typer.Option(
        "--gpus", min=1, max=MAX_PLAN_GPUS, help="GPUs available (the plan uses at most these)."
    ),
]
PlanNodeOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus-per-node",
        min=1,
        max=MAX_GPUS_PER_NODE,
        help="GPUs per node (default: the cluster's).",
    ),
]
PlanGpuOpt = Annotated[
    str | None,
    typer.Option("--gpu", help="GPU preset name or hardware file (default: the cluster's)."),
]
BatchOpt = Annotated[
    int, typer.Option("--global-batch", min=1, max=2**30, help="Sequences per optimizer step.")
]
SeqOpt = Annotated[int, typer.Option("--seq", min=1, max=2**30, help="Tokens per sequence.")]
ClusterOpt = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        help="Cluster preset name or cluster file (links, GPUs per node, host RAM); default: "
        "the preset of the GPU's nodes.",
    ),
]
ExplainOpt = Annotated[
    bool, typer.Option("--explain", help="Show each term of the chosen layout's step.")
]
TieBandOpt = Annotated[
    float,
    typer.Option(
        "--tie-band",
        min=0,
        max=50,
        help="Steps within this % of the fastest count as equally fast: the plan is the one "
        "of them with the most GPU headroom.",
    ),
]


#: how to read ``_layout``'s keys
LAYOUT_LEGEND = (
    "layout keys: tpN tensor parallel; ppN N pipeline stages (ppNxV: each rank holds V "
    "interleaved virtual stages); cpN context parallel; dpN data parallel; epN expert parallel "
    "(within dp); zeroS ZeRO stage S"
)


def _layout(c: PlanCandidate | dict[str, object]) -> str:
    p = c.parallel if isinstance(c, PlanCandidate) else c["parallel"]
    assert isinstance(p, dict)
    text = f"tp{p['tp']} pp{p['pp']}"
    if p["vpp"] > 1:
        text += f"x{p['vpp']}"
    text += f" cp{p['cp']} dp{p['dp']}"
    if p["ep"] > 1:
        text += f" ep{p['ep']}"
    return text + f" zero{p['zero_stage']}"


def _print_plan(result: PlanResult, explain: bool, console: Console) -> None:
    rb = result.rejected_by_reason
    console.print(
        f"{result.gpus} x {result.gpu} ({result.gpus_per_node} per node, {result.cluster}): "
        f"{result.candidates_considered:,} candidates over {result.layouts_considered:,} "
        f"layouts, {result.candidates_estimated:,} estimated; rejected: "
        + ", ".join(f"{k} {v:,}" for k, v in rb.items())
    )
    constraints = ", ".join(f"{k}={v}" for k, v in result.constraints.items())
    console.print(
        f"constraints: {constraints or 'none (the plan chooses every layout key)'}",
        markup=False,
    )
    console.print(result.zero_stages_reason, markup=False)
    console.print(result.reason, markup=False)
    if result.plan is None or result.budget is None:
        return
    p = result.plan
    console.print(
        f"plan: {_layout(p)} on {result.gpus_used} GPUs, micro_batch_size="
        f"{p['micro_batch_size']} grad_accum_steps={p['grad_accum_steps']} "
        f"recompute={recompute_text(p['recompute'])} offload={offload_text(p['offload'])}"
    )
    console.print(LAYOUT_LEGEND, markup=False, highlight=False)
    console.print(
        f"predicted: {result.predicted_step_seconds:.3f} s/step, "
        f"{result.predicted_tokens_per_second:,.0f} tokens/s, GPU peak "
        f"{planner.format_bytes(result.budget.gpu.peak_bytes)} ({result.budget.peak_phase}) "
        f"of {planner.format_bytes(result.budget.gpu.capacity_bytes)}"
    )
    default = (
        " (the default: the worst under-prediction of the published GPU runs)"
        if result.margin_pct is None
        else ""
    )
    console.print(
        f"margin {result.margin_pct_used:g} % of each peak{default}; tie band "
        f"{result.tie_band_pct:g} % (the roomiest of the layouts as fast as the fastest)",
        markup=False,
    )
    if result.near_capacity:
        console.print(
            f"near capacity: the peak is within {NEAR_CAPACITY_PCT:g} % of the GPU's memory; "
            "a run may fail on what the estimate does not see",
            markup=False,
        )
    if explain:
        table = Table("term", "seconds", "formula")
        for t in result.step:
            table.add_row(t.term, f"{t.seconds:.4f}", t.formula)
        console.print(table)
    if result.runners_up:
        table = Table("runner-up", "GPUs", "micro", "recompute", "offload", "s/step", "GPU peak")
        for c in result.runners_up:
            table.add_row(
                _layout(c),
                str(c.gpus_used),
                str(c.micro_batch_size),
                str(c.recompute),
                c.offload["mode"],
                f"{c.step_seconds:.3f}",
                planner.format_bytes(c.gpu_peak_bytes or 0),
            )
        console.print(table)
    for c in result.rejected[:5]:
        console.print(f"rejected {_layout(c)} micro {c.micro_batch_size}: {c.reason}")


def plan_command(
    model: ModelArg,
    gpus: GpusOpt,
    global_batch: BatchOpt,
    seq: SeqOpt,
    gpus_per_node: PlanNodeOpt = None,
    gpu: PlanGpuOpt = None,
    train: TrainOpt = None,
    set_: SetOpt = None,
    cluster: ClusterOpt = None,
    margin: MarginOpt = None,
    tie_band: TieBandOpt = TIE_BAND_PCT,
    explain: ExplainOpt = False,
    format: FormatOpt = TextOrJson.text,
) -> None:
    """Find the fastest parallel layout (TP, PP, CP, DP, EP, ZeRO, micro-batch, recompute,
    offload) of at most --gpus GPUs whose heaviest rank fits. A layout key the training spec
    names (--set parallel.tp=8, or in --train) is a constraint the search keeps to. Exit 0 with
    a plan, 1 when nothing fits, 2 on invalid input (a constraint no layout can meet too)."""
    with user_errors():
        result = run_plan(
            model,
            gpus,
            global_batch,
            seq,
            gpus_per_node,
            gpu,
            train,
            set_,
            cluster,
            margin,
            tie_band,
        )
    if format is TextOrJson.json:
        typer.echo(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        _print_plan(result, explain, Console())
    raise typer.Exit(ExitCode.OK if result.fits else ExitCode.NOTHING_FITS)


def run_plan(
    model: str,
    gpus: int,
    global_batch: int,
    seq: int,
    gpus_per_node: int | None,
    gpu: str | None,
    train: Path | None,
    set_: list[str] | None,
    cluster: str | None,
    margin: float | None,
    tie_band: float = TIE_BAND_PCT,
) -> PlanResult:
    """The specs the options name, and the plan."""
    spec = planner.load_model(model)
    # the layout keys the spec names (--train's file or preset, --set) are the constraints
    train_spec, constraints = split_plan_train(train_dict(train, set_ or []))
    hw = planner.load_hardware(gpu) if gpu is not None else None
    given = load_cluster(cluster) if cluster is not None else None
    cl, hardware = cluster_and_gpu(given, hw, gpus_per_node)
    return planner.plan(
        spec,
        train_spec,
        cl,
        hardware,
        gpus,
        global_batch,
        seq,
        margin_pct=margin,
        constraints=constraints,
        tie_band_pct=tie_band,
    )
