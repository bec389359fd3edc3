"""The ``torchtitan`` activation profile: torchtitan's own Llama 3 model code traced on the CPU
(``calibration.torchtitan``), fitted and held out as the other profiles are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration import torchtitan
from headroom.calibration.regression import FITTED, fit_coefficients, peak_errors
from headroom.calibration.shipped import shipped_entry
from headroom.calibration.trace_records import TracesFile, load_traces
from headroom.calibration.tracing import trace
from headroom.planner.estimator import layer_backward_bytes


@pytest.fixture(scope="module")
def traces() -> TracesFile:
    data = load_traces("torchtitan")
    assert data is not None
    return data


def test_held_out_traces_are_predicted_within_one_percent(traces: TracesFile) -> None:
    """Among the held-out runs: two shapes held out whole (one with tied embeddings at
    torchtitan's 1B width and vocabulary) and two-layer cuts of its 8B and 70B flavors at 2k
    to 8k tokens, with and without full checkpointing."""
    held_out = traces.held_out()
    names = {r.model.name for r in held_out}
    assert {"llama-3-8b", "llama-3-70b", "tt-trace-3", "tt-trace-6"} <= names
    assert {r.train.recompute for r in held_out} == {"none", "full"}
    coeffs = fit_coefficients(traces.fitted(), "torchtitan")
    errors = peak_errors(held_out, coeffs)
    assert len(errors) >= 20 and max(abs(e) for e in errors) <= 0.01, errors
    layers = [
        (layer_backward_bytes(r.model, r.train, coeffs) - m) / m
        for r in held_out
        for m in [r.layer_backward_peak_bytes]
        if m is not None
    ]
    assert len(layers) == len(held_out) and max(abs(e) for e in layers) <= 0.02, layers


def test_the_model_code_matters_transformers_profile_is_under(traces: TracesFile) -> None:
    """The same shapes under the ``hf`` profile (transformers' llama) and ``textbook``: both
    under torchtitan's model code, by more than the torchtitan profile's error."""
    held_out = traces.held_out()
    own = peak_errors(held_out, planner.default_coefficients("torchtitan"))
    hf = peak_errors(held_out, planner.default_coefficients("hf"))
    textbook = peak_errors(held_out, planner.default_coefficients("textbook"))
    assert min(hf) < -0.03 and min(textbook) < -0.1
    assert max(abs(e) for e in own) < min(abs(min(hf)), abs(min(textbook)))


def test_the_shipped_torchtitan_coefficients_are_the_fit_of_the_committed_records(
    traces: TracesFile,
) -> None:
    shipped = planner.default_coefficients("torchtitan")
    assert shipped.calibrated and shipped.num_records == len(traces.fitted())
    assert traces.torchtitan is not None and traces.torchtitan in (shipped.source or "")
    entry = shipped_entry("torchtitan")
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)


def test_a_committed_record_is_what_tracing_gives_today(traces: TracesFile) -> None:
    record = next(r for r in traces.records if r.train.recompute == "full")
    measured = trace(record.model, record.train, impl="torchtitan")
    assert record.peak is not None
    assert measured["peak"] == record.peak.model_dump()
    assert max(p["total"] for p in measured["layer_backward_peaks"]) == (
        record.layer_backward_peak_bytes
    )


def test_torchtitan_flavors_are_the_planner_presets_it_is_held_out_on() -> None:
    """The 8B and 70B cuts in the design are planner presets: they have torchtitan's shapes."""
    shape = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size")
    for flavor, preset in (("8B", "llama-3-8b"), ("70B", "llama-3-70b")):
        ours, theirs = planner.load_model(preset), torchtitan.flavor_spec(flavor)
        assert {k: getattr(ours, k) for k in shape} == {k: getattr(theirs, k) for k in shape}
        assert ours.num_layers == theirs.num_layers and not theirs.tied_embeddings
    assert torchtitan.flavor_spec("1B").tied_embeddings


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"qk_norm": True}, "model.qk_norm"),
        ({"qkv_bias": True}, "model.qkv_bias"),
        ({"ffn_kind": "gelu"}, "model.ffn_kind"),
    ],
)
def test_shapes_llama_3_cannot_express_are_refused_naming_the_field(
    update: dict[str, object], field: str
) -> None:
    spec = planner.load_model("tiny-dense").model_copy(update=update)
    with pytest.raises(planner.SpecError) as err:
        torchtitan.config_for(spec)
    assert err.value.field == field and "torchtitan" in str(err.value)


def test_calibrate_trace_runs_torchtitan_and_refuses_moe() -> None:
    ok = run_headroom(
        "calibrate", "trace", "tiny-dense", "--impl", "torchtitan",
        "--set", "activation_profile=torchtitan", "--set", "seq_len=128",
        "--set", "precision.params=bf16", "--set", "precision.grads=bf16",
        "--set", "precision.master=none", "--set", "precision.optimizer_states=bf16",
        "--format", "json", timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["impl"] == "torchtitan" and out["trace"]["impl"] == "torchtitan"
    assert abs(out["error"]["total"]) < 0.05, out["error"]
    refused = run_headroom(
        "calibrate", "trace", "tiny-moe", "--impl", "torchtitan",
        "--set", "precision.params=bf16", "--set", "precision.grads=bf16",
        "--set", "precision.master=none", "--set", "precision.optimizer_states=bf16",
        timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2 and "model.moe" in refused.stderr, refused.stderr


def test_calibrate_trace_runs_torchtitans_own_fsdp2(tmp_path: Path) -> None:
    """``--framework fsdp2 --impl torchtitan``: torchtitan's parallelize_llama on 8 fake ranks,
    compared with the estimate of its run (groups split)."""
    model = planner.load_model("llama-3-8b").model_copy(update={"num_layers": 2, "name": "l8b2"})
    path = tmp_path / "l8b2.json"
    path.write_text(model.model_dump_json())
    sets = {
        "framework": "fsdp2",
        "fsdp2.groups": "split",
        "activation_profile": "torchtitan",
        "parallel.dp": "8",
        "parallel.zero_stage": "3",
        "precision.grads": "fp32",
        "precision.master": "fp32",
        "seq_len": "2048",
        "recompute": "full",
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    proc = run_headroom(
        "calibrate", "trace", str(path), "--framework", "fsdp2", "--impl", "torchtitan",
        *args, "--format", "json", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["framework"], out["impl"], out["trace"]["impl"]) == ("fsdp2",) + ("torchtitan",) * 2
    assert abs(out["error"]["total"]) <= 0.01, out["error"]
