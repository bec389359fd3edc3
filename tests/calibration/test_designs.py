"""The calibration designs (``calibration/designs/*.json``) are the designs the committed traces
were collected from: record by record the same model, training spec, name and held-out flag, in
the same order, so the committed records and the shipped coefficients fitted from them stay
valid without tracing again. And the typed records write the files as they are committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headroom import planner
from headroom.calibration.design import configurations, load_design
from headroom.calibration.trace_records import TracesFile

DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"


@pytest.mark.parametrize("impl", ["runtime", "hf"])
def test_the_design_is_what_the_committed_traces_hold(impl: str) -> None:
    records: list[dict[str, Any]] = json.loads((DATA / f"{impl}-traces.json").read_text())[
        "records"
    ]
    runs = configurations(impl)
    assert len(runs) == len(records)
    for i, ((model, train, held_out), record) in enumerate(zip(runs, records, strict=True)):
        assert model.name == record["model"]["name"], i
        assert model.model_dump(mode="json") == record["model"], i
        # the hf records were written before the training spec gained max_grad_norm: read
        # back, they hold its default
        assert train == planner.TrainSpec.model_validate(record["train"]), i
        assert held_out is record["held_out"], i


@pytest.mark.parametrize("impl", ["runtime", "hf"])
def test_every_shape_says_why_and_every_run_names_its_split(impl: str) -> None:
    design = load_design(impl)
    names = [shape.name for shape in design.shapes]
    assert len(set(names)) == len(names)
    for shape in design.shapes:
        assert shape.why and shape.runs
        assert all(run.split in ("fitted", "held_out") for run in shape.runs)
        # a shape held out whole says so
        if all(run.split == "held_out" for run in shape.runs):
            assert "held out" in shape.why, shape.name


def test_the_typed_records_write_the_committed_files() -> None:
    text = (DATA / "runtime-traces.json").read_text()
    assert TracesFile.model_validate_json(text).to_json_text() == text
    # the hf file predates max_grad_norm; written again it gains the default, nothing else
    text = (DATA / "hf-traces.json").read_text()
    rewritten = json.loads(TracesFile.model_validate_json(text).to_json_text())
    for record in rewritten["records"]:
        assert record["train"].pop("max_grad_norm") == 1.0
    assert rewritten == json.loads(text)
    assert list(rewritten) == list(json.loads(text))


def test_the_shipped_coefficients_are_regressed_again_to_the_byte() -> None:
    """What ``python -m headroom.calibration.shipped`` writes is the committed coefficients file."""
    from headroom.calibration.shipped import SHIPPED, shipped_text

    text, _ = shipped_text()
    assert text == SHIPPED.read_text()
