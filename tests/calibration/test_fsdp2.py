"""FSDP2 traces on the CPU (``calibration.frameworks.fsdp2``): torchtitan's run of a transformers
model on rank 0 of a fake process group, under fake tensors as under real ones."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration import hf
from headroom.calibration.frameworks import fsdp2

#: a tiny llama (grouped KV heads, untied): every trace of it takes a second or two
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 352,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
MODEL = hf.spec_of(CONFIG)
TORCHTITAN = {"params": "bf16", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}


def _train(dp: int, tp: int = 1, **values: Any) -> planner.TrainSpec:
    return planner.TrainSpec.model_validate(
        {
            "micro_batch_size": 2,
            "seq_len": 64,
            "framework": "fsdp2",
            "precision": TORCHTITAN,
            "parallel": {"dp": dp, "tp": tp, "zero_stage": 3, "sequence_parallel": tp > 1},
            **values,
        }
    )


def _sharded_elements(world_size: int) -> int:
    """Rank 0's elements of every parameter: FSDP2 splits dim 0 into padded equal shards."""
    with torch.device("meta"):
        net = hf.build(CONFIG)
    return sum(math.ceil(p.shape[0] / world_size) * p[0].numel() for p in net.parameters())


@pytest.mark.parametrize(
    ("dp", "tp", "recompute"), [(4, 1, "none"), (2, 2, "full")], ids=["fsdp", "fsdp-tp-ac"]
)
def test_fake_tensors_trace_what_real_tensors_hold(dp: int, tp: int, recompute: str) -> None:
    """Phase by phase and category by category, the fake tensor trace is the real one, with
    tensor parallelism and per-layer checkpointing too."""
    train = _train(dp, tp, recompute=recompute)
    fake = fsdp2.trace(MODEL, train, config=CONFIG)
    real = fsdp2.trace(MODEL, train, config=CONFIG, mode="real")
    assert (fake["mode"], real["mode"]) == ("fake", "real")
    assert fake["phases"] == real["phases"]
    assert fake["layer_backward_peaks"] == real["layer_backward_peaks"]
    assert fake["peak"] == real["peak"] and fake["peak_phase"] == real["peak_phase"]
    assert list(fake["phases"]) == list(fsdp2.PHASES)
    assert fake["peak"]["total"] == max(p["total"] for p in fake["phases"].values())
    assert len(fake["layer_backward_peaks"]) == MODEL.num_layers


@pytest.mark.parametrize(
    ("impl", "temporaries"),
    [("fused", 0), ("foreach", 1)],
)
def test_the_sharded_state_is_what_fsdp2_keeps(impl: str, temporaries: int) -> None:
    """fp32 shards of every parameter (dim 0 split into padded equal shards), fp32 sharded
    gradients, AdamW's two fp32 moments and a 4-byte step per parameter; foreach's step also
    holds sqrt(v) of every local shard, fused nothing more."""
    dp = 3  # shards padded: no dimension of the model divides by 3
    measured = fsdp2.trace(MODEL, _train(dp, optimizer_impl=impl), config=CONFIG)
    shard = 4 * _sharded_elements(dp)
    with torch.device("meta"):
        tensors = len(list(hf.build(CONFIG).parameters()))
    states = 2 * shard + 4 * tensors
    forward, optimizer = measured["phases"]["forward"], measured["phases"]["optimizer"]
    assert forward["sharded_params"] == optimizer["sharded_params"] == shard
    assert forward["optimizer_states"] == states
    assert optimizer["sharded_grads"] == shard
    assert optimizer["optimizer_states"] == states + temporaries * shard
    assert "sharded_grads" not in forward  # zero_grad(set_to_none=True)
    assert measured["phases"]["step1_forward"].get("optimizer_states", 0) == 0


def test_dtensor_propagation_sharing_the_trace_fake_mode_shows_unsharded_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The known trap: under fake tensors, DTensor's sharding propagation runs in the trace's
    own fake mode and the tracker counts its global-shape tensors. foreach AdamW's first step
    then seems to hold more than an unsharded fp32 copy of the whole model beyond what it holds
    (once per process: DTensor caches the propagation). Propagating apart, as a real run does,
    the trace is the real run's."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    train = _train(4, optimizer_impl="foreach")
    with torch.device("meta"):
        unsharded = 4 * sum(p.numel() for p in hf.build(CONFIG).parameters())
    real = fsdp2.trace(MODEL, train, config=CONFIG, mode="real")
    _clear_sharding_prop_cache()  # as in a fresh process
    with monkeypatch.context() as patched:
        patched.setattr(fsdp2, "dtensor_propagation_apart", contextlib.nullcontext)
        shared = fsdp2.trace(MODEL, train, config=CONFIG)
    _clear_sharding_prop_cache()
    apart = fsdp2.trace(MODEL, train, config=CONFIG)

    def first_step(measured: dict[str, Any]) -> int:
        return int(measured["phases"]["step1_optimizer"]["optimizer_states"])

    assert first_step(shared) - first_step(real) >= unsharded
    assert apart["phases"] == real["phases"]
    # the second step's propagation is cached: no trace sees it there
    assert shared["phases"]["optimizer"] == real["phases"]["optimizer"]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"precision": {**TORCHTITAN, "master": "none"}}, "precision"),
        ({"parallel": {"dp": 8, "zero_stage": 2}}, "parallel.zero_stage"),
        ({"parallel": {"dp": 8, "pp": 2, "zero_stage": 3}}, "parallel.pp"),
        ({"parallel": {"dp": 4, "tp": 2, "zero_stage": 3}}, "parallel.sequence_parallel"),
        ({"recompute": "selective"}, "recompute"),
        ({"recompute": {"every_k": 2}}, "recompute"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"framework": "none"}, "framework"),
    ],
)
def test_a_run_fsdp2_does_not_make_is_refused_naming_the_field(
    values: dict[str, Any], field: str
) -> None:
    train = planner.TrainSpec.model_validate(
        {
            "framework": "fsdp2",
            "precision": TORCHTITAN,
            "parallel": {"dp": 8, "zero_stage": 3},
            **values,
        }
    )
    with pytest.raises(planner.SpecError) as info:
        fsdp2.trace(MODEL, train, config=CONFIG)
    assert info.value.field == field


def test_tensor_parallelism_needs_a_model_it_can_split() -> None:
    train = _train(2, 2)
    for config, field in (
        ({**CONFIG, "tie_word_embeddings": True}, "model.tied_embeddings"),
        ({**CONFIG, "num_key_value_heads": 1}, "parallel.tp"),
    ):
        with pytest.raises(planner.SpecError) as info:
            fsdp2.check_model(config, train)
        assert info.value.field == field
    with pytest.raises(planner.SpecError) as info:
        fsdp2.check_model(CONFIG, _train(2, 2, seq_len=63))
    assert info.value.field == "seq_len"


def test_calibrate_trace_framework_flag(tmp_path: Path) -> None:
    """``--framework fsdp2`` traces the hf model under FSDP2 and compares it with the estimate;
    an unknown framework, an implementation it does not run and ``--record`` are refused with
    one line and exit 2; the default stays the one-rank trace."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    args = ["--set", "parallel.dp=4", "--set", "parallel.zero_stage=3"]
    args += ["--set", "precision.grads=fp32", "--set", "activation_profile=hf"]
    proc = run_headroom(
        "calibrate", "trace", str(config), "--framework", "fsdp2", *args, "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["framework"], out["impl"]) == ("fsdp2", "hf")
    trace = out["trace"]
    assert out["measured_peak_bytes"] == trace["peak"]["total"]
    assert trace["peak_phase"] in trace["phases"]
    assert out["predicted"]["total"] > 0
    for bad, field, allowed in (
        (["--framework", "megatron"], "framework", "allowed: none, fsdp2"),
        (["--framework", "fsdp2", "--impl", "runtime"], "impl", "runs hf, torchtitan models"),
        (["--framework", "fsdp2", "--record"], "--record", "allowed with --framework none"),
    ):
        refused = run_headroom("calibrate", "trace", str(config), *bad, *args, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith(f"error: {field}:"), refused.stderr
        assert allowed in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_a_committed_record_is_traced_again_to_the_byte() -> None:
    """The committed FSDP2 traces are what the harness measures today: a record with tensor
    parallelism and checkpointing, traced again, is the committed record."""
    from headroom.calibration.collect import fsdp2_record
    from headroom.calibration.trace_records import load_framework_traces

    traces = load_framework_traces("hf-fsdp2")
    assert traces is not None and traces.framework == "fsdp2"
    committed = next(
        r
        for r in traces.records
        if r.train.parallel.tp == 8
        and r.train.recompute == "full"
        and r.model.name.startswith("llama3-8b")
    )
    again = fsdp2_record(committed.model, committed.train, committed.held_out)
    assert again == committed
