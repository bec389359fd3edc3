"""The ``torchtune`` activation profile: torchtune's own Llama 3.2 decoder code traced on the CPU
(``calibration.torchtune``), fitted and held out, and its layer under ``torch.compile`` (the
training spec's ``compile``), traced with real tensors and held to a shape the terms were not
solved from."""

from __future__ import annotations

import statistics

import pytest
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration import torchtune
from headroom.calibration.regression import FITTED, STRUCTURAL, peak_errors
from headroom.calibration.shipped import shipped_entry
from headroom.calibration.trace_records import TracesFile, load_traces
from headroom.calibration.tracing import trace
from headroom.planner.estimator import layer_backward_bytes


@pytest.fixture(scope="module")
def traces() -> TracesFile:
    data = load_traces("torchtune")
    assert data is not None
    return data


def test_the_design_spans_grouped_and_full_heads_tied_heads_and_checkpointing(
    traces: TracesFile,
) -> None:
    """Fitted and held out: grouped and multi-head attention, tied and untied heads, no
    checkpointing and the recipes' full checkpointing; shapes held out whole, among them
    Llama 3.2 3B's layer (its heads, FFN and tied vocabulary) and Llama 3.1 8B's at full width."""
    for held in (False, True):
        records = [r for r in traces.records if r.held_out is held]
        assert {r.model.tied_embeddings for r in records} == {True, False}, held
        assert {r.train.recompute for r in records} == {"none", "full"}, held
    # multi-head attention is held out whole: the fit has grouped heads only
    assert {r.model.kv_heads < r.model.num_heads for r in traces.fitted()} == {True}
    assert {r.model.kv_heads < r.model.num_heads for r in traces.held_out()} == {True, False}
    whole = {"tune-trace-3", "tune-trace-6", "llama-3-8b"}
    for name in whole:
        assert all(r.held_out for r in traces.records if r.model.name == name), name
    assert {r.model.name for r in traces.fitted()}.isdisjoint(whole)


def test_held_out_peaks_are_predicted_within_a_quarter_percent(traces: TracesFile) -> None:
    coeffs = planner.default_coefficients("torchtune")
    for records in (traces.held_out(), traces.fitted()):
        errors = peak_errors(records, coeffs)
        assert len(errors) >= 24 and max(abs(e) for e in errors) <= 0.0025, errors
        assert statistics.median(abs(e) for e in errors) <= 0.001


def test_a_layers_backward_is_predicted_within_one_and_a_half_percent(traces: TracesFile) -> None:
    coeffs = planner.default_coefficients("torchtune")
    errors = [
        (layer_backward_bytes(r.model, r.train, coeffs) - m) / m
        for r in traces.held_out()
        for m in [r.layer_backward_peak_bytes]
        if m is not None
    ]
    assert len(errors) >= 20 and max(abs(e) for e in errors) <= 0.015, errors


def test_the_model_code_matters(traces: TracesFile) -> None:
    """On torchtune's layers (fp32 norms, expanded keys and values, fp32 logits) the other
    profiles are off by several times its own worst."""
    held_out = traces.held_out()
    own = max(abs(e) for e in peak_errors(held_out, planner.default_coefficients("torchtune")))
    for other in ("hf", "torchtitan", "textbook", "runtime"):
        errors = peak_errors(held_out, planner.default_coefficients(other))
        assert max(abs(e) for e in errors) > 5 * own, other


def test_the_shipped_coefficients_are_the_fit_of_the_committed_records(
    traces: TracesFile,
) -> None:
    shipped = planner.default_coefficients("torchtune")
    assert shipped.calibrated and shipped.num_records == len(traces.fitted())
    assert traces.torchtune is not None and traces.torchtune in (shipped.source or "")
    entry = shipped_entry("torchtune")
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)
    for name, value in STRUCTURAL["torchtune"].items():
        assert getattr(shipped, name) == value, name
    assert not shipped.moe_traced and not shipped.selective_op


@pytest.mark.parametrize("index", [0, 4])
def test_committed_records_are_what_tracing_gives_today(traces: TracesFile, index: int) -> None:
    """A run without checkpointing and one under the recipes' checkpointing, traced again."""
    record = traces.records[index]
    measured = trace(record.model, record.train, impl="torchtune")
    assert record.peak is not None
    assert measured["peak"] == record.peak.model_dump()


def test_a_compiled_layer_saves_seven_hidden_and_one_ffn_tensor_fewer() -> None:
    """torchtune's layer compiled as ``compile_model`` compiles it, on a shape the terms were
    not solved from (multi-head attention, an FFN of 2.75x, 256 tokens): what autograd saves
    drops by exactly the shipped terms, 16-bit: 7 hidden-width and 1 FFN-width tensors a
    token."""
    hidden, ffn, tokens = 256, 704, 256
    assert (hidden, 4, 4, ffn, tokens) not in torchtune.COMPILE_SHAPES
    fewer = torchtune.compiled_fewer_bytes(hidden, 4, 4, ffn, tokens)
    coeffs = planner.default_coefficients("torchtune")
    assert coeffs.compiled_layer_hidden_tensors is not None
    assert coeffs.compiled_layer_ffn_tensors is not None
    expected = 2 * (
        coeffs.compiled_layer_hidden_tensors * hidden + coeffs.compiled_layer_ffn_tensors * ffn
    )
    assert fewer == expected


def _llama_3b() -> planner.ModelSpec:
    return planner.load_model("llama-3-8b").model_copy(
        update={
            "name": "llama-3.2-3b-shaped",
            "hidden_size": 3072,
            "num_layers": 28,
            "num_heads": 24,
            "num_kv_heads": 8,
            "ffn_hidden_size": 8192,
            "tied_embeddings": True,
        }
    )


def _train(**update: object) -> planner.TrainSpec:
    spec = {
        "micro_batch_size": 2,
        "seq_len": 4096,
        "activation_profile": "torchtune",
        "precision": {
            "params": "bf16",
            "grads": "bf16",
            "master": "none",
            "optimizer_states": "bf16",
        },
        **update,
    }
    return planner.load_train(spec)


def test_compile_lowers_each_layers_saved_activations_by_the_traced_terms() -> None:
    model, hw = _llama_3b(), planner.gpu("A100-80GB")
    eager = planner.estimate(model, _train(), hw).gpu.phases["forward"].buckets["activations"]
    compiled = planner.estimate(model, _train(compile=True), hw)
    tokens = 2 * 4096
    per_layer = 2 * tokens * (7 * 3072 + 8192)
    assert eager - compiled.gpu.phases["forward"].buckets["activations"] == 28 * per_layer
    # under full checkpointing a layer keeps its input only: the compiled layer changes only
    # the recomputed layer's working set
    full = planner.estimate(model, _train(recompute="full"), hw)
    full_compiled = planner.estimate(model, _train(recompute="full", compile=True), hw)
    assert 0 <= full.gpu_peak_bytes - full_compiled.gpu_peak_bytes <= per_layer


@pytest.mark.parametrize(
    ("update", "says"),
    [
        ({"activation_profile": "hf"}, "profiles that price it: torchtune"),
        (
            {"precision": {"params": "fp32", "grads": "fp32", "master": "none"}},
            "16-bit activations",
        ),
        ({"parallel": {"tp": 2}}, "one tensor-parallel rank"),
    ],
)
def test_compile_is_refused_where_it_was_not_traced(update: dict[str, object], says: str) -> None:
    with pytest.raises(planner.SpecError, match=says) as caught:
        planner.estimate(_llama_3b(), _train(compile=True, **update), planner.gpu("A100-80GB"))
    assert caught.value.field == "compile"


def test_the_cli_refuses_compile_for_a_profile_without_it_with_exit_2() -> None:
    result = run_headroom(
        "estimate",
        "llama-3-8b",
        "--set",
        "compile=true",
        "--set",
        "activation_profile=hf",
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "compile" in result.stderr and "torchtune" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"ffn_kind": "gelu"}, "model.ffn_kind"),
        ({"qk_norm": True}, "model.qk_norm"),
        ({"qkv_bias": True}, "model.qkv_bias"),
        ({"hidden_size": 500}, "model.head_dim"),
    ],
)
def test_shapes_torchtunes_llama_cannot_express_are_refused_naming_the_field(
    update: dict[str, object], field: str
) -> None:
    spec = planner.load_model("llama-3-8b").model_copy(update=update)
    with pytest.raises(planner.SpecError, match=r"torchtune's Llama 3\.2") as caught:
        torchtune.check_model(spec)
    assert caught.value.field == field


def test_the_estimates_assumptions_name_compiled_layers() -> None:
    from headroom.cli.render import assumptions

    assert "loss standard, compiled layers;" in assumptions(_train(compile=True))
    assert "compiled" not in assumptions(_train())
