"""``headroom presets``: the bundled GPU and model presets, as tables or JSON."""

from __future__ import annotations

import json

import typer
from rich.console import Console

from headroom import planner
from headroom.cli.options import FormatOpt, TextOrJson


def presets_command(format: FormatOpt = TextOrJson.text) -> None:
    """List the bundled GPU, model and run presets (a run preset is a training spec a project
    ships: ``--train NAME``)."""
    gpus = [planner.gpu(name) for name in planner.gpu_names()]
    models = planner.model_names()
    runs = [planner.load_run(name) for name in planner.run_names()]
    if format is TextOrJson.json:
        payload = {
            "runs": [run.model_dump() for run in runs],
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
    table = Table(title="Run presets (--train NAME)")
    for column in ("name", "model", "GPUs", "framework", "source"):
        table.add_column(column, overflow="fold")
    for run in runs:
        table.add_row(
            run.name, run.model, f"{run.gpus} x {run.gpu}", run.train.framework, run.source
        )
    console.print(table)
