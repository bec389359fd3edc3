"""``framework: deepspeed`` against DeepSpeed's own estimators of ZeRO's model states
(``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``,
``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, DeepSpeed 0.19.8 as
``make install`` installs it). Where the two differ, the test states by how much and the docs
say why (docs/ESTIMATOR.md, "Frameworks: framework: deepspeed")."""

from __future__ import annotations

import os
from typing import Any

import pytest

from headroom import planner

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks an accelerator on import
stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")

MODEL = planner.load_model("llama-3-8b")
P = planner.count_params(MODEL).total
# DeepSpeed's estimators count 16-bit parameters and gradients and fp32 master weights, moments
# and gradients; its fused Adam has no temporaries
FP16 = {"params": "fp16", "grads": "fp16", "master": "fp32", "optimizer_states": "fp32"}
STATES = ("params", "grads", "master_params", "optimizer_states")


def _train(stage: int, dp: int, **values: Any) -> planner.TrainSpec:
    spec: dict[str, Any] = {
        "framework": "deepspeed",
        "precision": FP16,
        "optimizer_impl": "fused",
        "parallel": {"dp": dp, "zero_stage": stage},
        "deepspeed": {"stage3_param_persistence_threshold": 0},
    }
    return planner.TrainSpec.model_validate({**spec, **values})


def _budget(train: planner.TrainSpec) -> planner.Budget:
    return planner.estimate(
        MODEL, train, planner.gpu("H100-80GB").model_copy(update={"gpus_per_node": 8})
    )


def _model_states(budget: planner.Budget) -> int:
    """The model states of the optimizer step (its largest moment for them): parameters,
    gradients, master weights, moments and the step's fp32 gradients."""
    row = budget.gpu.phases["optimizer"].buckets
    return sum(row[b] for b in STATES)


def _held(train: planner.TrainSpec) -> int:
    """What the framework holds in a layer's backward (``transfer_buffers`` there)."""
    coeffs = planner.default_coefficients("textbook")
    states = planner.estimator.stage_terms_from_knobs(MODEL, planner.knobs(train), coeffs, 0).states
    assert set(states.layer_transfer) == {states.transfer_buffers}
    return states.transfer_buffers


def _part(dp: int) -> int:
    return -(-P // dp)


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_zero2_model_states_are_deepspeeds(dp: int) -> None:
    """Stage 2: 16-bit parameters whole, 18 bytes per partition element (16-bit gradients,
    fp32 gradients, master weights and two moments): DeepSpeed's 2P + 18P/N, to rounding."""
    _, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        P, num_gpus_per_node=dp, cpu_offload=False
    )
    ours = _model_states(_budget(_train(2, dp)))
    assert ours == 2 * P + 18 * _part(dp)
    assert abs(ours - gpu) <= 18


def test_zero2_offloaded_model_states_are_deepspeeds() -> None:
    """Stage 2 with the optimizer on the CPU: the GPU keeps the 16-bit parameters only, as
    DeepSpeed says; the host keeps 16 bytes per element on a node (DeepSpeed adds 50 % buffer,
    and at more than 4 ranks a node 4 bytes per element per rank: every process's fp32 copy
    while the model is built)."""
    dp = 4
    cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        P, num_gpus_per_node=dp, cpu_offload=True
    )
    budget = _budget(_train(2, dp, offload={"mode": "optimizer", "fraction": 1.0}))
    assert _model_states(budget) == gpu == 2 * P
    assert budget.host_peak_bytes == dp * 16 * _part(dp)
    assert abs(budget.host_peak_bytes * 1.5 - cpu) <= 16 * dp * 1.5
    cpu8, _ = stage_1_and_2.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=8)
    assert cpu8 == int(P * 4 * 8 * 1.5)  # the build-time copies: not a step's memory


@pytest.mark.parametrize("dp", [8, 64])
def test_zero3_model_states_are_deepspeeds_and_its_16bit_gradient_partition(dp: int) -> None:
    """Stage 3: every state in 1/N partitions. DeepSpeed's estimator counts 18 bytes per
    partition element beside its largest layer; the step also holds the 16-bit gradient
    partition it converts to fp32 (``_prepare_fp32_grad_for_sub_group``): 20. (Its estimator
    takes the whole partition as one sub-group: so does the spec here.)"""
    largest = planner.estimator.stage_terms_from_knobs(
        MODEL, planner.knobs(_train(3, dp)), planner.default_coefficients("textbook"), 0
    ).stage_params.dense_layer_numel
    _, gpu, largest_memory = stage3.estimate_zero3_model_states_mem_needs(
        P, largest, num_gpus_per_node=dp, cpu_offload=False
    )
    whole = {"stage3_param_persistence_threshold": 0, "sub_group_size": 2**40}
    ours = _model_states(_budget(_train(3, dp, deepspeed=whole)))
    assert ours == 20 * _part(dp)
    assert abs((ours - 2 * _part(dp)) - (gpu - largest_memory)) <= 18
    # the largest layer's 16-bit parameters, gathered in backward (its 16-bit gradients are
    # the running layer's, in grads): with nothing kept live and nothing prefetched, one layer
    spec = _train(
        3,
        dp,
        deepspeed={
            "stage3_max_live_parameters": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 1,
            "overlap_comm": False,
        },
    )
    held = _held(spec)
    assert held == 2 * largest + 2  # + the one-element reduction bucket
    assert 2 * held - 4 == largest_memory


def test_zero3_offloaded_optimizer_is_deepspeeds() -> None:
    """Stage 3, optimizer on the CPU, parameters on the GPU: the 16-bit partition on the GPU
    (DeepSpeed: 2P/N beside its largest layer), 16 bytes per element on the host (DeepSpeed
    adds 50 %)."""
    dp = 8
    cpu, gpu, largest_memory = stage3.estimate_zero3_model_states_mem_needs(
        P, 1, num_gpus_per_node=dp, cpu_offload=True, cpu_offload_params=False
    )
    budget = _budget(_train(3, dp, offload={"mode": "optimizer", "fraction": 1.0}))
    assert _model_states(budget) == 2 * _part(dp)
    assert abs(_model_states(budget) - (gpu - largest_memory)) <= 2
    assert budget.host_peak_bytes == dp * 16 * _part(dp)
    assert abs(budget.host_peak_bytes * 1.5 - cpu) <= 16 * dp * 1.5


@pytest.mark.parametrize("impl", ["foreach", "for_loop", "fused"])
def test_zero2_steps_one_flat_partition_and_its_temporaries_are_its_size(impl: str) -> None:
    """DeepSpeed hands torch's optimizer one flat fp32 partition per parameter group, so an
    unfused AdamW's temporaries are partition-sized, not the model's largest tensor's: LLaMA-7B
    on 8 V100s with ZeRO-2 failed allocating exactly one partition's fp32 bytes inside Adam
    ("Tried to allocate 3.14 GiB", LLaMA-Factory issue 1221)."""
    llama7b = planner.load_model(
        {
            "name": "llama-7b",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "num_layers": 32,
            "num_heads": 32,
            "ffn_hidden_size": 11008,
        }
    )
    fp16 = {**FP16}
    train = _train(2, 8, precision=fp16, optimizer_impl=impl)
    budget = planner.estimate(llama7b, train, planner.gpu("A100-40GB"))
    states = planner.estimator.stage_terms_from_knobs(
        llama7b, planner.knobs(train), planner.default_coefficients("textbook"), 0
    ).states
    part = -(-planner.count_params(llama7b).total // 8)
    assert round(part * 4 / 2**30, 2) == 3.14  # the allocation that failed
    copies = {"foreach": 1, "for_loop": 2, "fused": 0}[impl]
    # the partition's fp32 gradients, then the step's sqrt(v) (and its quotient, for_loop)
    assert states.optimizer_temporaries == part * 4 + copies * part * 4
    assert budget.gpu.phases["optimizer"].buckets["optimizer_states"] == (
        states.optimizer_states + states.optimizer_temporaries
    )


def test_zero3_steps_one_sub_group_at_a_time() -> None:
    """Stage 3 prepares each sub-group's fp32 gradients, steps it and frees them
    (``stage3.py``: ``_prepare_fp32_grad_for_sub_group``, ``_release_sub_group``): the step
    holds one sub-group's, ``sub_group_size`` elements (DeepSpeed's default 1e9)."""
    part = _part(8)

    def temporaries(sub_group: int, impl: str) -> int:
        train = _train(3, 8, optimizer_impl=impl, deepspeed={"sub_group_size": sub_group})
        return planner.estimator.stage_terms_from_knobs(
            MODEL, planner.knobs(train), planner.default_coefficients("textbook"), 0
        ).states.optimizer_temporaries

    assert temporaries(2**40, "foreach") == part * 8
    assert temporaries(10**9, "foreach") == 10**9 * 8
    assert temporaries(10**8, "for_loop") == 10**8 * 12
    assert temporaries(10**8, "fused") == 10**8 * 4


def test_the_buckets_are_deepspeeds_knobs() -> None:
    """Stage 2's reduction buckets (two with overlap_comm) in backward, stage 3's live
    parameters and prefetch bucket; stage 1 keeps every gradient."""
    back = _held(_train(2, 8, deepspeed={"reduce_bucket_size": 100_000_000}))
    overlap = _held(
        _train(2, 8, deepspeed={"reduce_bucket_size": 100_000_000, "overlap_comm": True})
    )
    assert back == 100_000_000 * 2
    assert overlap == 2 * back
    # stage 1 holds every gradient until the backward's end, then its partition
    coeffs = planner.default_coefficients("textbook")
    one = planner.estimator.stage_terms_from_knobs(
        MODEL, planner.knobs(_train(1, 8)), coeffs, 0
    ).states
    assert one.grads_tail >= 2 * P and one.grads_total == 2 * _part(8)
    live = _budget(_train(3, 8, deepspeed={"stage3_max_live_parameters": 2_000_000_000}))
    fewer = _budget(_train(3, 8, deepspeed={"stage3_max_live_parameters": 0}))
    assert live.gpu_peak_bytes > fewer.gpu_peak_bytes


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"parallel": {"dp": 8, "zero_stage": 0}}, "parallel.zero_stage"),
        ({"offload": {"mode": "streaming"}}, "offload.mode"),
    ],
)
def test_deepspeed_refuses_what_it_does_not_run(values: dict[str, Any], field: str) -> None:
    with pytest.raises(planner.SpecError) as info:
        _budget(_train(2, 8, **values))
    assert info.value.field == field


#: a two-layer llama DeepSpeed steps for real on the CPU (``calibration.frameworks.deepspeed``)
TINY = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _buffers_train(stage: int) -> planner.TrainSpec:
    bf16 = {**FP16, "params": "bf16", "grads": "bf16"}
    return _train(
        stage,
        2,
        precision=bf16,
        micro_batch_size=2,
        seq_len=64,
        deepspeed={
            "reduce_bucket_size": 100_000,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": 0,
        },
    )


@pytest.fixture(scope="module")
def stepped(request: pytest.FixtureRequest) -> dict[int, dict[str, int]]:
    """The buffers of every stage the session runs, stepped in one world of two ranks (they
    start and import DeepSpeed once, not once a stage)."""
    from headroom.calibration.frameworks import deepspeed as probe

    name = "test_the_buffers_deepspeed_makes_are_the_estimates"
    stages = sorted(
        {
            item.callspec.params["stage"]
            for item in request.session.items
            if isinstance(item, pytest.Function) and item.originalname == name
        }
    )
    found = probe.buffers_of(TINY, [_buffers_train(stage) for stage in stages])
    return dict(zip(stages, found, strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_buffers_deepspeed_makes_are_the_estimates(
    stage: int, stepped: dict[int, dict[str, int]]
) -> None:
    """DeepSpeed ZeRO run for real (2 ranks over gloo on the CPU, two steps of a two-layer
    transformers llama): the bytes of the buffers it made on rank 0 are the estimate's terms:
    16-bit parameters, fp32 master partition, moments, the 16-bit gradient partition and the
    reduction bucket."""
    from headroom.calibration import hf

    train = _buffers_train(stage)
    found = stepped[stage]
    model = hf.spec_of(TINY)
    coeffs = planner.default_coefficients("textbook")
    states = planner.estimator.stage_terms_from_knobs(model, planner.knobs(train), coeffs, 0).states
    numel = planner.count_params(model).total
    assert found["elements"] == numel
    assert found["params"] == states.params
    assert found["master_params"] == states.master_params
    # the moments, and one step counter per parameter group (4 bytes)
    assert found["optimizer_states"] - 4 == states.optimizer_states
    assert found["grads"] == states.grads_total
    assert found["reduction_buckets"] == 100_000 * 2
    if stage < 3:  # the bucket exists through backward only: all the framework holds there
        assert states.transfer_buffers == found["reduction_buckets"]
        assert states.forward_transfer == 0
    else:  # stage 3's is made with the optimizer and kept, beside the gathered parameters
        gathered = states.transfer_buffers - found["reduction_buckets"]
        assert gathered >= 2 * model_unit(model)
        assert states.forward_transfer == states.transfer_buffers


def model_unit(model: planner.ModelSpec) -> int:
    """Elements of one decoder layer of ``model`` (no tensor or pipeline parallelism)."""
    coeffs = planner.default_coefficients("textbook")
    spec = planner.TrainSpec()
    return planner.estimator.stage_terms_from_knobs(
        model, planner.knobs(spec), coeffs, 0
    ).stage_params.dense_layer_numel
