"""The ``framework`` axis: FSDP2's terms in the estimate, its rules, and the key in the CLI,
the API and the ladder."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app
from headroom.planner.estimator import knobs, stage_terms_from_knobs
from tests.headroom_process import run_headroom

TORCHTITAN = {"params": "bf16", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}
MODEL = planner.load_model("llama-3-8b")
GPU = planner.gpu("H100-80GB")


def _train(**values: Any) -> planner.TrainSpec:
    spec: dict[str, Any] = {
        "seq_len": 8192,
        "framework": "fsdp2",
        "activation_profile": "hf",
        "precision": TORCHTITAN,
        "parallel": {"dp": 8, "zero_stage": 3},
    }
    return planner.TrainSpec.model_validate({**spec, **values})


def test_the_default_is_no_framework() -> None:
    train = planner.TrainSpec()
    assert train.framework == "none" and train.fsdp2.reshard_after_forward
    assert planner.FRAMEWORKS == ("none", "fsdp2", "deepspeed", "megatron")


def test_fsdp2_shards_parameters_without_a_master_copy() -> None:
    """fp32 sharded parameters only (the shards are the master weights), fp32 sharded
    gradients in the optimizer phase, moments over the 8 ranks; the root gathered in bf16 with
    a block through forward."""
    train = _train()
    t = stage_terms_from_knobs(MODEL, knobs(train), planner.default_coefficients("hf"), 0)
    sp = t.stage_params
    shards = -(-sp.dense_numel // 8)
    assert t.states.params == shards * 4
    assert t.states.master_params == 0
    assert t.states.grads_total == shards * 4
    assert t.states.optimizer_states == 2 * shards * 4
    root = sp.embedding_numel + sp.head_unit_numel
    assert t.states.forward_transfer == (root + sp.dense_layer_numel) * 2
    # a middle layer's backward: the root, the block, the one prefetched and the block
    # above's fp32 reduce-scatter input; the bottom prefetches nothing, the top reduces nothing
    middle, bottom, top, only = t.states.layer_transfer
    unit = sp.dense_layer_numel
    assert middle == root * 2 + 2 * unit * 2 + unit * 4
    assert middle - bottom == unit * 2
    assert middle - top == unit * 4
    assert only == (root + unit) * 2
    optimizer = planner.estimate(MODEL, train, GPU).gpu.phases["optimizer"].buckets
    assert optimizer["transfer_buffers"] == 0 and optimizer["master_params"] == 0


def test_resharding_after_forward_trades_memory_for_gathers() -> None:
    """Keeping every block gathered from forward to backward holds more than resharding."""
    resharded = planner.estimate(MODEL, _train(), GPU).gpu.peak_bytes
    kept = planner.estimate(MODEL, _train(fsdp2={"reshard_after_forward": False}), GPU)
    assert kept.gpu.peak_bytes > resharded


def test_fsdp2_grows_with_tensor_parallel_inputs() -> None:
    """DTensor's column-wise projections save their gathered input: under TP the fsdp2
    estimate holds more activations than plain sequence parallelism does."""
    parallel = {"dp": 8, "tp": 4, "zero_stage": 3, "sequence_parallel": True}
    fsdp2 = planner.estimate(MODEL, _train(parallel=parallel), GPU)
    plain = planner.estimate(MODEL, _train(parallel=parallel, framework="none"), GPU)
    forward = "forward"
    assert (
        fsdp2.gpu.phases[forward].buckets["activations"]
        > plain.gpu.phases[forward].buckets["activations"]
    )


@pytest.mark.parametrize(
    ("values", "field", "allowed"),
    [
        ({"parallel": {"dp": 8, "zero_stage": 2}}, "parallel.zero_stage", "allowed: 3"),
        ({"offload": {"mode": "optimizer"}}, "offload.mode", "allowed: none"),
    ],
)
def test_fsdp2_refuses_what_it_does_not_run(
    values: dict[str, Any], field: str, allowed: str
) -> None:
    with pytest.raises(planner.SpecError) as info:
        planner.estimate(MODEL, _train(**values), GPU)
    assert info.value.field == field and allowed in str(info.value)


def test_an_unknown_framework_is_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match="framework"):
        planner.TrainSpec.model_validate({"framework": "colossalai"})


def test_the_api_takes_the_framework_and_refuses_a_bad_one() -> None:
    client = TestClient(create_app())
    body = {"model": "llama-3-8b", "gpu": "H100-80GB", "train": _train().model_dump()}
    response = client.post("/api/v1/estimate", json=body)
    assert response.status_code == 200
    assert (
        response.json()["gpu"]["peak_bytes"]
        == planner.estimate(MODEL, _train(), GPU).gpu.peak_bytes
    )
    for train, field in (
        ({"framework": "colossalai"}, "train.framework"),
        ({"framework": "fsdp2", "parallel": {"dp": 8}}, "parallel.zero_stage"),
    ):
        bad = client.post("/api/v1/estimate", json={"model": "llama-3-8b", "train": train})
        assert bad.status_code == 422, bad.text
        assert bad.headers["content-type"].startswith("application/problem+json")
        assert field in bad.json()["detail"]


def test_the_cli_sets_the_framework() -> None:
    args = ["--gpu", "H100-80GB", "--set", "framework=fsdp2", "--set", "parallel.dp=8"]
    args += ["--set", "parallel.zero_stage=3", "--set", "activation_profile=hf"]
    proc = run_headroom("estimate", "llama-3-8b", *args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    budget = json.loads(proc.stdout)
    expected = planner.estimate(
        MODEL,
        planner.TrainSpec.model_validate(
            {
                "framework": "fsdp2",
                "activation_profile": "hf",
                "parallel": {"dp": 8, "zero_stage": 3},
            }
        ),
        GPU,
    )
    assert budget["gpu"]["peak_bytes"] == expected.gpu.peak_bytes
    refused = run_headroom("estimate", "llama-3-8b", "--set", "framework=colossalai")
    assert refused.returncode == 2
    assert "framework" in refused.stderr and "fsdp2" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_the_ladder_keeps_fsdp2s_sharding() -> None:
    """The auto-fit search varies the batch shape and recompute under fsdp2, never ZeRO or
    offload, which fsdp2 fixes."""
    train = _train(micro_batch_size=8)
    result = planner.fit(MODEL, train, GPU)
    assert result.plan is not None
    plan = planner.TrainSpec.model_validate(result.plan)
    assert plan.framework == "fsdp2"
    assert plan.parallel.zero_stage == 3 and plan.offload.mode == "none"
    assert planner.estimate(MODEL, plan, GPU).fits
    assert plan != train


def test_compare_shows_every_framework_and_model_code() -> None:
    """One configuration under each (framework, activation profile): each row is the estimate
    of that pair, fsdp2 with the keys it fixes named; the CLI and the API answer the same."""
    train = planner.TrainSpec.model_validate({"seq_len": 8192, "parallel": {"dp": 8}})
    rows = planner.compare(MODEL, train, GPU)
    pairs = [(c.framework, c.activation_profile) for c in rows]
    profiles = planner.coefficients.profiles()
    assert pairs == [(f, p) for f in planner.FRAMEWORKS for p in profiles]
    # each framework's least ZeRO stage: fsdp2 shards everything, DeepSpeed is ZeRO 1 and up,
    # Megatron shards with its own distributed optimizer (off at ZeRO 0)
    stage = {"none": 0, "fsdp2": 3, "deepspeed": 1, "megatron": 0}
    for c in rows:
        spec = {
            "seq_len": 8192,
            "framework": c.framework,
            "activation_profile": c.activation_profile,
            "parallel": {"dp": 8, "zero_stage": stage[c.framework]},
        }
        if c.framework == "megatron":
            spec["megatron"] = {"use_distributed_optimizer": False}
        expected = planner.estimate(MODEL, planner.TrainSpec.model_validate(spec), GPU)
        assert c.gpu_peak_bytes == expected.gpu_peak_bytes and c.peak_phase == expected.peak_phase
        zero = stage[c.framework]
        changed: dict[str, object] = {"parallel.zero_stage": zero} if zero else {}
        if c.framework == "megatron":
            changed = {"megatron.use_distributed_optimizer": False}
        assert c.changed == changed
        assert c.error is None
    # the CLI's --compare and the API's compare field
    proc = run_headroom(
        "estimate", "llama-3-8b", "--gpu", "H100-80GB", "--set", "seq_len=8192",
        "--set", "parallel.dp=8", "--compare", "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["compare"] == [c.model_dump() for c in rows]
    client = TestClient(create_app())
    body = {"model": "llama-3-8b", "gpu": "H100-80GB", "train": train.model_dump()}
    answer = client.post("/api/v1/estimate", json={**body, "compare": True})
    assert answer.status_code == 200
    assert answer.json()["compare"] == [c.model_dump() for c in rows]
    assert "compare" not in client.post("/api/v1/estimate", json=body).json()
    assert client.post("/api/v1/estimate", json={**body, "compare": 1}).status_code == 422


def test_compare_says_why_a_pair_cannot_run() -> None:
    """Streaming with tensor parallelism cannot run under any framework: every row says why,
    none has a budget."""
    train = planner.TrainSpec.model_validate(
        {"offload": {"mode": "streaming"}, "parallel": {"dp": 2, "tp": 2}}
    )
    rows = planner.compare(MODEL, train, GPU)
    none_rows = [c for c in rows if c.framework == "none"]
    assert none_rows and all(c.error and "offload.mode" in c.error for c in none_rows)
    assert all(c.gpu_peak_bytes is None and c.fits is None for c in none_rows)
    # fsdp2 and DeepSpeed drop the offload they do not run, and say so
    for c in rows:
        if c.framework == "fsdp2":
            assert c.changed == {"parallel.zero_stage": 3, "offload.mode": "none"}
        if c.framework == "deepspeed":
            assert c.changed == {"parallel.zero_stage": 1, "offload.mode": "none"}
        if c.framework == "megatron":
            assert c.changed == {
                "megatron.use_distributed_optimizer": False,
                "offload.mode": "none",
            }
        if c.framework != "none":
            assert c.error is None and c.gpu_peak_bytes is not None


@pytest.mark.parametrize("profile", ["torchtitan", "megatron"])
def test_a_profile_fitted_to_dense_layers_refuses_an_moe_model(profile: str) -> None:
    """The torchtitan and megatron profiles were traced on dense layers only: an MoE model
    under them would count no expert activations (published MoE runs came out 22-27 % under),
    so it is refused naming the field and the profiles that have MoE terms; a dense model is
    not. The CLI exits 2 and the API answers 422 with the same words."""
    moe = planner.load_model("qwen3-30b-a3b")
    train = planner.TrainSpec.model_validate({"activation_profile": profile})
    with pytest.raises(planner.SpecError) as info:
        planner.estimate(moe, train, GPU)
    assert info.value.field == "activation_profile"
    message = str(info.value)
    assert f"the {profile} profile has no MoE terms" in message
    assert message.endswith("an MoE model needs one of: hf, runtime, textbook")
    assert planner.estimate(MODEL, train, GPU).gpu_peak_bytes > 0
    for having in ("hf", "runtime", "textbook"):
        spec = planner.TrainSpec.model_validate({"activation_profile": having})
        assert planner.estimate(moe, spec, GPU).gpu_peak_bytes > 0
    proc = run_headroom(
        "estimate", "qwen3-30b-a3b", "--gpu", "H100-80GB",
        "--set", f"activation_profile={profile}", "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 2 and "has no MoE terms" in proc.stderr
    assert "Traceback" not in proc.stderr
    answer = TestClient(create_app()).post(
        "/api/v1/estimate",
        json={"model": "qwen3-30b-a3b", "gpu": "H100-80GB", "train": train.model_dump()},
    )
    assert answer.status_code == 422
    assert "has no MoE terms" in answer.text


def test_fsdp2_under_pipelining_accumulates_unsharded_gradients_until_the_step_ends() -> None:
    """torch's pipelining runs every micro-batch's backward with resharding after backward and
    gradient sync off and reduces once at the step's end (``stage.py``: ``backward_one_chunk``,
    ``perform_reduce_grad``): a stage holds all its groups gathered and its gradients unsharded
    in ``reduce_dtype`` through forward and backward; the optimizer reads the shards. Without
    it, torchtitan's 405B runs on 8 stages came out 33-41 % under their published peaks."""
    model = planner.load_model("llama-3-70b")
    spec = {"grad_accum_steps": 8, "recompute": "full", "fsdp2": {"reshard_after_forward": False}}
    flat = _train(parallel={"dp": 8, "tp": 8, "zero_stage": 3}, **spec)
    piped = _train(parallel={"dp": 8, "tp": 8, "pp": 4, "zero_stage": 3}, **spec)
    states = stage_terms_from_knobs(
        model, knobs(piped), planner.default_coefficients("hf"), 0
    ).states
    sp = states.stage_params
    stage = sp.dense_numel + sp.expert_numel  # the first stage's local elements
    assert states.grads_start == states.grads_total == stage * 4  # fp32, unsharded
    assert states.transfer_buffers == states.forward_transfer == stage * 2  # bf16, gathered
    assert states.layer_transfer == (stage * 2,) * 4 and states.released_transfer == (0, 0)
    assert states.step_grads == -(-stage // 8) * 4  # the shards the reduction leaves
    budget = planner.estimate(model, piped, GPU)
    backward = budget.gpu.phases["backward"].buckets
    assert backward["grads"] >= stage * 4 and backward["transfer_buffers"] == stage * 2
    assert budget.gpu.phases["optimizer"].buckets["grads"] == states.step_grads
    # the same layout without stages keeps gradients sharded and one block gathered
    flat_states = stage_terms_from_knobs(
        model, knobs(flat), planner.default_coefficients("hf"), 0
    ).states
    whole = flat_states.stage_params.dense_numel
    assert flat_states.step_grads is None and flat_states.grads_total == -(-whole // 8) * 4
