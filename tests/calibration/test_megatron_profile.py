"""The ``megatron`` activation profile: Megatron-Core's own GPT with its local layers traced on
the CPU (``calibration.megatron``), fitted and held out as the other profiles are."""

from __future__ import annotations

import json

import pytest
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration import megatron
from headroom.calibration.regression import FITTED, peak_errors
from headroom.calibration.shipped import shipped_entry
from headroom.calibration.trace_records import TracesFile, load_traces
from headroom.calibration.tracing import trace
from headroom.planner.estimator import layer_backward_bytes

PURE_BF16 = ("precision.params=bf16", "precision.grads=bf16", "precision.master=none")


@pytest.fixture(scope="module")
def traces() -> TracesFile:
    data = load_traces("megatron")
    assert data is not None
    return data


def _llama_style(traces: TracesFile) -> list:  # type: ignore[type-arg]
    return [r for r in traces.held_out() if r.model.ffn_kind == "swiglu"]


def test_held_out_llama_style_traces_are_predicted_within_one_and_a_half_percent(
    traces: TracesFile,
) -> None:
    """Among them: two shapes held out whole (one with tied embeddings at a 128k vocabulary),
    query/key norms, and a two-layer cut of Llama 3 8B at 4k and 8k tokens."""
    held_out = _llama_style(traces)
    assert {"llama-3-8b", "mc-trace-3", "mc-trace-6", "mc-trace-qk"} <= {
        r.model.name for r in held_out
    }
    coeffs = planner.default_coefficients("megatron")
    errors = peak_errors(held_out, coeffs)
    assert len(errors) >= 20 and max(abs(e) for e in errors) <= 0.015, errors
    layers = [
        (layer_backward_bytes(r.model, r.train, coeffs) - m) / m
        for r in held_out
        if not r.model.tied_embeddings
        for m in [r.layer_backward_peak_bytes]
        if m is not None
    ]
    assert len(layers) >= 15 and max(abs(e) for e in layers) <= 0.03, layers


def test_gpt_style_layers_are_outside_the_family_on_the_safe_side(traces: TracesFile) -> None:
    """GPT-3-style layers (GeLU, LayerNorm, biases, dropout), held out whole: the Llama-style
    fit over-predicts them (up to 15 %), never under by more than a rounding."""
    gpt = [r for r in traces.records if r.model.ffn_kind == "gelu"]
    assert gpt and all(r.held_out for r in gpt)
    errors = peak_errors(gpt, planner.default_coefficients("megatron"))
    assert min(errors) >= -0.001 and max(errors) <= 0.16, errors


def test_the_model_code_matters(traces: TracesFile) -> None:
    """On Megatron's Llama-style layers the other profiles are off by more than its own."""
    held_out = _llama_style(traces)
    own = max(abs(e) for e in peak_errors(held_out, planner.default_coefficients("megatron")))
    for other in ("hf", "torchtitan", "textbook"):
        errors = peak_errors(held_out, planner.default_coefficients(other))
        assert max(abs(e) for e in errors) > 2 * own, other


def test_the_shipped_megatron_coefficients_are_the_fit_of_the_committed_records(
    traces: TracesFile,
) -> None:
    shipped = planner.default_coefficients("megatron")
    assert shipped.calibrated and shipped.num_records == len(traces.fitted())
    assert traces.megatron_core is not None and traces.megatron_core in (shipped.source or "")
    entry = shipped_entry("megatron")
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_a_committed_record_is_what_tracing_gives_today(traces: TracesFile, kind: str) -> None:
    record = next(r for r in traces.records if r.model.ffn_kind == kind)
    measured = trace(record.model, record.train, impl="megatron")
    assert record.peak is not None
    assert measured["peak"] == record.peak.model_dump()


def test_shapes_megatron_cannot_build_are_refused_naming_the_field() -> None:
    spec = planner.load_model("tiny-moe")
    with pytest.raises(planner.SpecError) as err:
        megatron.check_model(spec)
    assert err.value.field == "model.moe"
    partial = planner.load_model("tiny-dense").model_copy(update={"mlp_bias": True})
    with pytest.raises(planner.SpecError) as err:
        megatron.check_model(partial)
    assert err.value.field == "model.mlp_bias"


def test_calibrate_trace_runs_megatron_and_refuses_its_checkpointing() -> None:
    sets = [x for kv in (*PURE_BF16, "precision.optimizer_states=bf16") for x in ("--set", kv)]
    ok = run_headroom(
        "calibrate", "trace", "tiny-dense", "--impl", "megatron",
        "--set", "activation_profile=megatron", "--set", "seq_len=128", *sets,
        "--format", "json", timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["impl"] == "megatron" and out["trace"]["impl"] == "megatron"
    refused = run_headroom(
        "calibrate", "trace", "tiny-dense", "--impl", "megatron", "--set", "recompute=full",
        *sets, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2 and "recompute" in refused.stderr, refused.stderr
