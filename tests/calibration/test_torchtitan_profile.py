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
from headroom.calibration.tracing import steady_forward_transient, trace
from headroom.planner.activations import selective_op_layer_bytes
from headroom.planner.estimator import layer_backward_bytes


@pytest.fixture(scope="module")
def traces() -> TracesFile:
    data = load_traces("torchtitan")
    assert data is not None
    return data


def test_held_out_traces_are_predicted_within_one_percent(traces: TracesFile) -> None:
    """Among the held-out runs: shapes held out whole (one with tied embeddings at
    torchtitan's 1B width and vocabulary; two-layer cuts of its 3B and 405B flavors) and
    two-layer cuts of its 8B and 70B flavors at 2k to 8k tokens, without checkpointing, with
    its FullAC and with its per-op SelectiveAC."""
    held_out = traces.held_out()
    names = {r.model.name for r in held_out}
    whole = {"tt-trace-3", "tt-trace-6", "tt-llama3-3b", "llama-3.1-405b"}
    assert {"llama-3-8b", "llama-3-70b", *whole} <= names
    assert not any(r.model.name in whole for r in traces.fitted())
    assert {r.train.recompute for r in held_out} == {"none", "full", "selective_op"}
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
    # selective_op aside: the hf profile refuses it (no trace of transformers' code runs it)
    held_out = [r for r in traces.held_out() if r.train.recompute != "selective_op"]
    own = peak_errors(held_out, planner.default_coefficients("torchtitan"))
    hf = peak_errors(held_out, planner.default_coefficients("hf"))
    textbook = peak_errors(held_out, planner.default_coefficients("textbook"))
    assert min(hf) < -0.03 and min(textbook) < -0.1
    assert max(abs(e) for e in own) < min(abs(min(hf)), abs(min(textbook)))


def test_the_shipped_torchtitan_coefficients_are_the_fit_of_the_committed_records(
    traces: TracesFile,
) -> None:
    shipped = planner.default_coefficients("torchtitan")
    # no term is fitted to the selective_op runs (fit_coefficients): they check the derivation
    fitted_to = [r for r in traces.fitted() if r.train.recompute != "selective_op"]
    assert shipped.calibrated and shipped.num_records == len(fitted_to) < len(traces.fitted())
    assert shipped.selective_op and shipped.selective_op_saves_attention_inputs
    assert traces.torchtitan is not None and traces.torchtitan in (shipped.source or "")
    entry = shipped_entry("torchtitan")
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("recompute", ["full", "selective_op"])
def test_a_committed_record_is_what_tracing_gives_today(traces: TracesFile, recompute: str) -> None:
    record = next(r for r in traces.records if r.train.recompute == recompute)
    measured = trace(record.model, record.train, impl="torchtitan")
    assert record.peak is not None
    assert measured["peak"] == record.peak.model_dump()
    assert max(p["total"] for p in measured["layer_backward_peaks"]) == (
        record.layer_backward_peak_bytes
    )


def test_what_selective_op_keeps_is_the_derivation_to_the_byte(traces: TracesFile) -> None:
    """torchtitan's own SelectiveAC on its own Llama 3: what a run keeps through forward
    beyond the same run under FullAC is, to the byte, each layer's derived selective_op
    bytes less its checkpoint (the policy's matmul, attention and input outputs; nothing
    fitted), on every shape traced both ways."""
    coeffs = planner.default_coefficients("torchtitan")
    runs = {
        (r.model.name, r.train.micro_batch_size, r.train.seq_len, str(r.train.recompute)): r
        for r in traces.records
    }
    pairs = 0
    for (name, mb, seq, recompute), r in runs.items():
        full = runs.get((name, mb, seq, "full"))
        if recompute != "selective_op" or full is None:
            continue
        m = r.model
        kept = selective_op_layer_bytes(m, coeffs, mb, seq, 2, False, 1, 1, False)
        layer_input = mb * seq * m.hidden_size * 2
        difference = r.forward_transient_bytes - full.forward_transient_bytes
        assert difference == m.num_layers * (kept - layer_input), m.name
        pairs += 1
    assert pairs >= 15


def test_selective_op_runs_are_predicted_within_the_profiles_bounds(traces: TracesFile) -> None:
    """Every traced selective_op run (widths of 512 to 16384 cut to 2-4 blocks, 1k-8k tokens,
    the 3B and 405B cuts held out whole) under the shipped coefficients: the peak within 1 %
    and a layer's backward within 2 %, as the profile's other runs; its re-run block is a
    full-recompute block (recompute_hidden_tensors), nothing fitted to these runs."""
    runs = [r for r in traces.records if r.train.recompute == "selective_op"]
    assert len(runs) >= 20 and sum(r.held_out for r in runs) >= 15
    assert {r.model.hidden_size for r in runs} >= {512, 2048, 3072, 4096, 8192, 16384}
    coeffs = planner.default_coefficients("torchtitan")
    errors = peak_errors(runs, coeffs)
    assert max(abs(e) for e in errors) <= 0.01, errors
    layers = [
        (layer_backward_bytes(r.model, r.train, coeffs) - m) / m
        for r in runs
        for m in [r.layer_backward_peak_bytes]
        if m is not None
    ]
    assert len(layers) == len(runs) and max(abs(e) for e in layers) <= 0.02, layers


def test_the_trace_saves_the_compiled_attentions_inputs_as_a_gpu_would() -> None:
    """On a GPU torchtitan's FlexAttention runs as compiled code, one operator of the policy's
    save list whose outputs are the attention's output, its log-sum-exp and the queries, keys
    and values its backward needs, so the policy keeps all five. The trace runs its stand-in
    as that operator: called directly, the policy would see only allocations it does not save
    and the run would keep each layer's attention output, log-sum-exp, Q, K and V less."""
    model = planner.load_model("tiny-dense").model_copy(
        update={"num_layers": 2, "tied_embeddings": False}
    )
    train = planner.TrainSpec(
        seq_len=256,
        recompute="selective_op",
        activation_profile="torchtitan",
        precision={"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"},
    )
    compiled = trace(model, train, impl="torchtitan")
    original = torchtitan.flex_attention_as_on_a_gpu
    try:
        torchtitan.flex_attention_as_on_a_gpu = lambda compiled_region=False: original(False)  # type: ignore[assignment,misc]
        direct = trace(model, train, impl="torchtitan")
    finally:
        torchtitan.flex_attention_as_on_a_gpu = original  # type: ignore[assignment]
    tokens, d, heads = train.seq_len, model.dim_per_head, model.num_heads
    qkv = tokens * (heads + 2 * model.kv_heads) * d * 2
    out, lse = tokens * heads * d * 2, tokens * heads * 4
    kept = steady_forward_transient(compiled) - steady_forward_transient(direct)
    assert kept == model.num_layers * (qkv + out + lse)


def test_torchtitans_published_8b_step_is_priced_within_a_few_percent_as_selective_op() -> None:
    """torchtitan's Llama 3 8B on 64 A100s under its per-op checkpointing
    (``published-throughput.json``): priced as ``selective_op``, the recompute of the matmuls
    the policy does not keep brings the step within a few percent of the published one,
    between ``selective`` (-6.6 %) and ``full``."""
    from headroom.calibration import throughput

    case = next(
        c for c in throughput.published()["cases"] if c["id"] == "torchtitan-llama3-8b-sac-op"
    )
    errors = {}
    for recompute in ("selective", "selective_op", "full"):
        run = throughput.replay({**case, "recompute": recompute})
        errors[recompute] = run.predicted_seconds / run.published_seconds - 1
    assert errors["selective"] < errors["selective_op"] < errors["full"], errors
    assert abs(errors["selective_op"]) < 0.04, errors


def test_tracing_other_model_code_refuses_selective_op() -> None:
    train = planner.TrainSpec(
        seq_len=64,
        recompute="selective_op",
        precision={"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"},
    )
    for impl in ("runtime", "hf"):
        with pytest.raises(planner.SpecError, match="torchtitan's model code runs") as err:
            trace(planner.load_model("tiny-dense"), train, impl=impl)
        assert err.value.field == "recompute"


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
