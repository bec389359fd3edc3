"""The options the commands share, and the specs they name loaded once.

Each alias is a typed ``Annotated`` option so that every command spells ``--gpu``, ``--train``,
``--set`` ... with the same help text; ``load_specs`` turns them into the planner's validated
model, training and hardware specs (a ``planner.HeadroomError`` on a user mistake).
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from headroom import planner
from headroom.planner.hardware import MAX_GPUS_PER_NODE
from headroom.planner.io import apply_overrides, read_train_source, run_preset_named

__all__ = [
    "FormatOpt",
    "GpuOpt",
    "HostOpt",
    "MarginOpt",
    "MaxProbesOpt",
    "ModelArg",
    "NodeOpt",
    "ProbeDevice",
    "ProbeDeviceOpt",
    "ProbeOpt",
    "RecordOpt",
    "SetOpt",
    "TextOrJson",
    "TrainOpt",
    "load_specs",
    "stored_coefficients",
    "train_dict",
]


class TextOrJson(StrEnum):
    text = "text"
    json = "json"


class ProbeDevice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


ModelArg = Annotated[str, typer.Argument(help="Preset name, model JSON/YAML, or config.json.")]
TrainOpt = Annotated[
    Path | None,
    typer.Option(
        "--train",
        help="Training spec (JSON or YAML), or a run preset's name (headroom presets).",
        dir_okay=False,
    ),
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
    int | None,
    typer.Option(
        "--gpus-per-node",
        min=1,
        max=MAX_GPUS_PER_NODE,
        help="GPUs sharing the host RAM.",
    ),
]
FormatOpt = Annotated[TextOrJson, typer.Option("--format", help="Output format.")]


def _margin(value: float | None) -> float | None:
    # a range check alone lets NaN through (every comparison with it is false) and calls
    # infinity "more than 100": both are refused as what they are, not finite numbers
    if value is not None and not (math.isfinite(value) and 0 <= value <= 100):
        raise typer.BadParameter(f"must be a finite number from 0 to 100, got {value}")
    return value


MarginOpt = Annotated[
    float | None,
    typer.Option(
        "--margin",
        callback=_margin,
        help="Safety margin, % of the predicted peak (a number from 0 to 100).",
    ),
]
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


def train_dict(
    train_file: Path | None, assignments: list[str], model: planner.ModelSpec | None = None
) -> dict[str, Any]:
    """The training spec's raw dict: ``--train``'s file, run preset (``headroom presets``) or
    nothing, with ``--set`` applied."""
    data: Any = {}
    if train_file is not None:
        preset = run_preset_named(train_file)
        # the keys the preset names, as its file names them: the rest are the defaults either
        # way, and a plan reads the named layout keys as its constraints
        if preset is not None:
            data = preset.train.model_dump(exclude_unset=True)
        else:
            stack, data = read_train_source(train_file)
            if stack is not None:
                stack = stack.with_model(model.hidden_size) if model is not None else stack
                if (line := stack.warning(str(train_file))) is not None:
                    typer.echo(f"warning: {line}", err=True)
                data = stack.train
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise planner.InputFormatError(f"{train_file}: expected a JSON/YAML object")
    return apply_overrides(data, assignments)


def stored_coefficients(train: planner.TrainSpec, hw: planner.Hardware) -> planner.Coefficients:
    """``--calibrated``'s coefficients: the store's fitted set of the spec's activation profile
    on ``hw``, judged by the trust its stack (GPU, framework, profile) has earned from its
    recent records (``calibration.stored.calibrated_for``); ``NotCalibrated`` if it has none."""
    # the store (SQLAlchemy) only when asked for: the plain estimate and gate need no database
    from headroom.calibration.stored import calibrated_for
    from headroom.store import open_store

    with open_store()() as session:
        return calibrated_for(
            session=session, profile=train.activation_profile, hw=hw, framework=train.framework
        )


def load_specs(
    model: str,
    train: Path | None,
    set_: list[str] | None,
    gpu: str,
    host_memory: str | None,
    gpus_per_node: int | None,
) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware]:
    """The model, training and hardware specs the shared options name, validated."""
    spec = planner.load_model(model)
    train_spec = planner.load_train(train_dict(train, set_ or [], spec))
    hw = planner.load_hardware(
        gpu,
        host_memory=host_memory,
        gpus_per_node=gpus_per_node,
        host_memory_field="--host-memory",
        gpus_per_node_field="--gpus-per-node",
    )
    return spec, train_spec, hw
