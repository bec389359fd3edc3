"""The calibration designs (``calibration/designs/*.json``) are the designs the committed traces
were collected from: record by record the same model, training spec, name and held-out flag,
in the same order (the hf records were written before the training spec gained
``max_grad_norm``, so their training specs are compared as read back), so the committed records and the shipped coefficients fitted from them stay
valid without tracing again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headroom import planner
from headroom.calibration.collect import design

DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"


@pytest.mark.parametrize("impl", ["runtime", "hf"])
def test_the_design_is_what_the_committed_traces_hold(impl: str) -> None:
    records: list[dict[str, Any]] = json.loads((DATA / f"{impl}-traces.json").read_text())[
        "records"
    ]
    runs = design(impl)
    assert len(runs) == len(records)
    for i, ((model, train, held_out), record) in enumerate(zip(runs, records, strict=True)):
        assert model.name == record["model"]["name"], i
        assert model.model_dump(mode="json") == record["model"], i
        # the hf traces predate max_grad_norm: read back, they hold its default
        assert train == planner.TrainSpec.model_validate(record["train"]), i
        assert held_out is record["held_out"], i
