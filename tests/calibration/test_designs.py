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
from headroom.calibration.design import DESIGNS, FRAMEWORK_DESIGNS, configurations, load_design
from headroom.calibration.trace_records import FrameworkTracesFile, TracesFile

DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"
#: the model's fields the committed records predate, with the defaults they read back as
LAYER_SHAPES: dict[str, Any] = {
    "norm_params": None,
    "norm_placement": "pre",
    "qk_norm_weights": "shared",
    "sliding_window": None,
    "global_attention_every": None,
    "attn_logit_softcap": None,
    "final_logit_softcap": None,
}


def _without_layer_shapes(record: dict[str, Any]) -> None:
    """``record``'s model without the fields its file predates, each at its default."""
    for key, default in LAYER_SHAPES.items():
        assert record["model"].pop(key) == default, key


@pytest.mark.parametrize("impl", DESIGNS)
def test_the_design_is_what_the_committed_traces_hold(impl: str) -> None:
    records: list[dict[str, Any]] = json.loads((DATA / f"{impl}-traces.json").read_text())[
        "records"
    ]
    runs = configurations(impl)
    assert len(runs) == len(records)
    for i, ((model, train, held_out), record) in enumerate(zip(runs, records, strict=True)):
        assert model.name == record["model"]["name"], i
        # the records before the model gained the families' layer shapes (all but the
        # torchtune file's): read back, they hold their defaults (a Llama-shaped layer)
        assert model == planner.ModelSpec.model_validate(record["model"]), i
        older = set(LAYER_SHAPES) if impl != "torchtune" else set()
        assert model.model_dump(mode="json", exclude=older) == record["model"], i
        # the hf records were written before the training spec gained max_grad_norm: read
        # back, they hold its default
        assert train == planner.TrainSpec.model_validate(record["train"]), i
        assert held_out is record["held_out"], i


@pytest.mark.parametrize("impl", DESIGNS)
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
    # every file but torchtune's predates the pipeline schedule and compile: written again,
    # its specs gain their defaults
    text = (DATA / "runtime-traces.json").read_text()
    rewritten = json.loads(TracesFile.model_validate_json(text).to_json_text())
    for record in rewritten["records"]:
        _without_layer_shapes(record)
        assert record["train"]["parallel"].pop("pp_schedule") is None
        assert record["train"].pop("compile") is False
    assert rewritten == json.loads(text)
    # the hf file predates max_grad_norm, the frameworks, the interleaved schedule, the loss
    # and the step in the backward; written again it gains their defaults, nothing else
    text = (DATA / "hf-traces.json").read_text()
    rewritten = json.loads(TracesFile.model_validate_json(text).to_json_text())
    for record in rewritten["records"]:
        _without_layer_shapes(record)
        assert record["train"].pop("max_grad_norm") == 1.0
        assert record["train"].pop("framework") == "none"
        assert record["train"].pop("fsdp2") == {"reshard_after_forward": True, "groups": "root"}
        assert record["train"].pop("deepspeed")["reduce_bucket_size"] == 500_000_000
        assert record["train"].pop("megatron")["use_distributed_optimizer"] is True
        assert record["train"]["parallel"].pop("vpp") == 1
        assert record["train"]["parallel"].pop("pp_schedule") is None
        assert record["train"].pop("loss") == {
            "impl": "standard",
            "chunks": None,
            "compiled": False,
        }
        assert record["train"].pop("optimizer_in_backward") is False
        assert record["train"].pop("compile") is False
    assert rewritten == json.loads(text)
    assert list(rewritten) == list(json.loads(text))
    for name in (*FRAMEWORK_DESIGNS, "torchtitan", "megatron"):
        text = (DATA / f"{name}-traces.json").read_text()
        kind = FrameworkTracesFile if name in FRAMEWORK_DESIGNS else TracesFile
        rewritten = json.loads(kind.model_validate_json(text).to_json_text())
        for record in rewritten["records"]:
            _without_layer_shapes(record)
            assert record["train"]["parallel"].pop("pp_schedule") is None
            assert record["train"].pop("compile") is False
        assert rewritten == json.loads(text), name
    # the torchtune file is written by today's types: exactly
    text = (DATA / "torchtune-traces.json").read_text()
    assert TracesFile.model_validate_json(text).to_json_text() == text


def test_the_fsdp2_design_spans_the_runs_it_is_held_to() -> None:
    """8 to 256 ranks, with and without checkpointing and tensor parallelism, llama and qwen2,
    fitted and held out, every run as torchtitan's FSDP2 default (ZeRO-3, fp32 master and
    states, bf16 compute, fp32 reduction, sequence parallelism with tensor parallelism)."""
    runs = configurations("hf-fsdp2")
    assert {t.framework for _, t, _ in runs} == {"fsdp2"}
    ranks = {t.parallel.dp * t.parallel.tp for _, t, _ in runs}
    assert min(ranks) == 8 and max(ranks) == 256
    # every (recompute, tensor parallel, qwen2's Q/K/V biases) fitted and held out
    every = {(r, tp, q) for r in ("none", "full") for tp in (False, True) for q in (False, True)}
    for held_out in (False, True):
        kinds = {(t.recompute, t.parallel.tp > 1, m.qkv_bias) for m, t, h in runs if h == held_out}
        assert kinds == every, held_out
    for _, train, _ in runs:
        assert train.parallel.zero_stage == 3
        assert train.parallel.sequence_parallel is (train.parallel.tp > 1)
        assert train.precision.model_dump() == {
            "params": "bf16",
            "grads": "fp32",
            "master": "fp32",
            "optimizer_states": "fp32",
        }


def test_a_design_without_a_framework_runs_one_rank() -> None:
    from headroom.calibration.design import Design

    design = load_design("hf").model_dump()
    design["shapes"][0]["runs"][0]["dp"] = 8
    with pytest.raises(ValueError, match="dp and tp need a framework"):
        Design.model_validate(design)


def test_the_shipped_coefficients_are_regressed_again_to_the_byte() -> None:
    """What ``python -m headroom.calibration.shipped`` writes is the committed coefficients file."""
    from headroom.calibration.shipped import SHIPPED, shipped_text

    text, _ = shipped_text()
    assert text == SHIPPED.read_text()
