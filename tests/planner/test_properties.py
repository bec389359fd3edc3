"""Property tests of the estimator over generated dense and MoE models and training specs.

Invariants: every bucket is a non-negative int in every phase, the peak is the largest phase
total and equals the sum of the reported buckets, and ``fits`` never holds above capacity.
Monotonicity: the GPU peak grows with micro-batch size and sequence length, and shrinks with
offloaded optimizer fraction, stronger recompute and higher ZeRO stages.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from headroom import planner
from headroom.planner.estimator import (
    end_stages,
    knobs,
    stage_parts,
    stage_terms,
    stage_terms_from_knobs,
    stages_allocated,
)
from headroom.planner.phases import phase_totals
from headroom.planner.stage import stage_params

SETTINGS = settings(max_examples=60, deadline=None)
GPU_NAMES = planner.gpu_names()
PROFILES = planner.profiles()


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


@st.composite
def model_specs(draw: st.DrawFn, *, moe: bool | None = None) -> planner.ModelSpec:
    """Small-to-medium decoder-only transformers, dense or MoE (optionally MLA)."""
    hidden = 64 * draw(st.integers(1, 64))
    heads = draw(st.sampled_from(_divisors(hidden, limit=min(hidden, 128))))
    kv_heads = draw(st.none() | st.sampled_from(_divisors(heads)))
    layers = draw(st.integers(1, 48))
    fields: dict[str, Any] = {
        "vocab_size": draw(st.integers(1000, 200_000)),
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "ffn_hidden_size": draw(st.integers(1, 64)) * 64,
        "ffn_kind": draw(st.sampled_from(["swiglu", "gelu"])),
        "norm": draw(st.sampled_from(["rmsnorm", "layernorm"])),
        "tied_embeddings": draw(st.booleans()),
        "qkv_bias": draw(st.booleans()),
        "qk_norm": draw(st.booleans()),
        "attention_out_bias": draw(st.booleans()),
        "mlp_bias": draw(st.booleans()),
        "linear_bias": draw(st.booleans()),
        "dropout": draw(st.booleans()),
    }
    if moe is None:
        moe = draw(st.booleans())
    if moe:
        experts = draw(st.integers(2, 64))
        shared = draw(st.integers(0, 2))
        fields["moe"] = planner.MoESpec(
            num_experts=experts,
            top_k=draw(st.integers(1, experts)),
            expert_ffn_size=draw(st.integers(1, 32)) * 64,
            num_shared_experts=shared,
            shared_expert_ffn_size=draw(st.none() | st.integers(1, 32).map(lambda k: 64 * k)),
            shared_expert_gate=bool(shared) and draw(st.booleans()),
            dense_first_layers=draw(st.integers(0, min(layers, 3))),
            layer_freq=draw(st.integers(1, 3)),
            router_bias=draw(st.booleans()),
        )
    if draw(st.integers(0, 4)) == 0:  # now and then, DeepSeek-style latent attention
        fields["num_kv_heads"] = None
        fields["qk_norm"] = False
        fields["mla"] = planner.MLASpec(
            q_lora_rank=draw(st.none() | st.integers(1, 16).map(lambda k: 64 * k)),
            kv_lora_rank=draw(st.integers(1, 8)) * 64,
            qk_nope_head_dim=draw(st.sampled_from([32, 64, 128])),
            qk_rope_head_dim=draw(st.sampled_from([0, 32, 64])),
            v_head_dim=draw(st.sampled_from([32, 64, 128])),
        )
    return planner.ModelSpec(**fields)


@st.composite
def train_specs(draw: st.DrawFn) -> planner.TrainSpec:
    """Any valid training spec: precision, optimizer, recompute, parallelism, offload, the
    framework (each with the ZeRO stages and offload it runs)."""
    framework = draw(st.sampled_from(["none", "fsdp2", "deepspeed", "megatron"]))
    fsdp2, deepspeed, megatron = (framework == f for f in ("fsdp2", "deepspeed", "megatron"))
    modes = ["none", "optimizer", "streaming"]
    if fsdp2:
        modes = ["none"]
    elif deepspeed or megatron:
        modes = ["none", "optimizer"]
    mode = draw(st.sampled_from(modes))
    streaming = mode == "streaming"
    dp = draw(st.sampled_from([1, 2, 4, 8]))
    cp = draw(st.sampled_from([1, 2]))
    parallel = planner.Parallel(
        dp=dp,
        cp=cp,
        tp=1 if streaming else draw(st.sampled_from([1, 2, 4])),
        pp=1 if streaming else draw(st.sampled_from([1, 2, 4])),
        ep=draw(st.sampled_from(_divisors(dp * cp))),
        sequence_parallel=draw(st.booleans()),
        zero_stage=3 if fsdp2 else 0 if megatron else draw(st.integers(int(deepspeed), 3)),
    )
    offload = planner.Offload(
        mode=mode,
        fraction=draw(st.floats(0.0, 1.0)),
        checkpoint_every=draw(st.none() | st.integers(1, 6)),
        num_buffers=draw(st.integers(2, 3)),
    )
    precision = planner.Precision(
        params=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        grads=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        master=draw(st.sampled_from(["fp32", "bf16", "fp16", "none"])),
        optimizer_states=draw(st.sampled_from(["fp32", "bf16", "fp16"])),
    )
    recompute = draw(
        st.sampled_from(["none", "selective", "full"])
        | st.integers(1, 8).map(lambda k: planner.Recompute(every_k=k))
    )
    return planner.TrainSpec(
        micro_batch_size=draw(st.integers(1, 8)),
        seq_len=draw(st.integers(1, 8192)),
        grad_accum_steps=draw(st.integers(1, 4)),
        precision=precision,
        optimizer=draw(
            st.sampled_from(
                ["adamw", "adam", "sgd", "sgd_momentum", "muon", "adafactor", "adamw_8bit"]
            )
        ),
        optimizer_impl=draw(st.sampled_from(["foreach", "fused", "for_loop"])),
        recompute=recompute,
        attention=draw(st.sampled_from(["flash", "eager"])),
        activation_profile=draw(st.sampled_from(PROFILES)),
        ema=draw(st.sampled_from(["none", "gpu", "host"])),
        parallel=parallel,
        offload=offload,
        moe_capacity_factor=draw(st.none() | st.floats(0.5, 2.0)),
        moe_imbalance=draw(st.floats(1.0, 2.0)),
        expandable_segments=draw(st.booleans()),
        framework=framework,
        fsdp2=planner.Fsdp2(
            reshard_after_forward=draw(st.booleans()),
            groups=draw(st.sampled_from(["root", "split"])),
        ),
        megatron=planner.Megatron(use_distributed_optimizer=draw(st.booleans())),
    )


hardware = st.sampled_from(GPU_NAMES).map(planner.gpu)


def _with(train: planner.TrainSpec, **update: Any) -> planner.TrainSpec:
    """A copy of ``train`` with fields replaced, validated again."""
    return planner.TrainSpec.model_validate({**train.model_dump(), **update})


def _with_parallel(train: planner.TrainSpec, **update: Any) -> planner.TrainSpec:
    return _with(train, parallel={**train.parallel.model_dump(), **update})


def _fitted(model: planner.ModelSpec, train: planner.TrainSpec) -> planner.TrainSpec:
    """``train``'s layout moved onto ``model``, as the planner requires (``check_layout``): the
    largest TP degree up to the drawn one that divides the heads and FFN widths, at most a
    stage per layer, whole experts per EP rank, and a sequence that sequence parallelism splits
    (the model and the training spec are drawn independently), and for an MoE model a profile
    with MoE terms."""
    p = train.parallel
    widths = [model.num_heads, model.kv_heads, model.ffn_hidden_size]
    if model.moe is not None:
        widths += [model.moe.expert_ffn_size, model.moe.shared_ffn]
    tp = max(d for d in range(1, p.tp + 1) if math.gcd(*widths) % d == 0)
    if (
        model.moe is not None
        and not planner.default_coefficients(train.activation_profile).moe_traced
    ):
        # a profile fitted to dense layers refuses an MoE model: the one with MoE traces
        train = train.model_copy(update={"activation_profile": "hf"})
    return _with_parallel(
        train,
        tp=tp,
        pp=min(p.pp, model.num_layers),
        ep=math.gcd(p.ep, model.moe.num_experts) if model.moe is not None else 1,
        sequence_parallel=p.sequence_parallel and train.seq_len % tp == 0,
    )


def _peak(model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware) -> int:
    return planner.estimate(model, train, hw).gpu.peak_bytes


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


# --- invariants --------------------------------------------------------------------------


@SETTINGS
@given(model=model_specs(), train=train_specs(), hw=hardware)
def test_buckets_are_nonnegative_ints_and_peak_is_consistent(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
) -> None:
    train = _fitted(model, train)
    budget = planner.estimate(model, train, hw)
    gpu = budget.gpu

    assert set(gpu.phases) == set(planner.PHASES)
    for name, phase in gpu.phases.items():
        assert list(phase.buckets) == list(planner.GPU_BUCKETS), name
        for bucket, value in phase.buckets.items():
            assert _is_count(value), (name, bucket, value)
        assert _is_count(phase.total_bytes), name
        assert phase.total_bytes == sum(phase.buckets.values()), name

    assert list(budget.host.buckets) == list(planner.HOST_BUCKETS)
    for bucket, value in budget.host.buckets.items():
        assert _is_count(value), ("host", bucket, value)
    assert budget.host.peak_bytes == sum(budget.host.buckets.values())

    assert _is_count(gpu.peak_bytes)
    assert gpu.peak_bytes == sum(gpu.buckets.values())
    assert gpu.peak_bytes == max(p.total_bytes for p in gpu.phases.values())
    assert budget.peak_phase in planner.PHASES
    assert gpu.buckets == gpu.phases[budget.peak_phase].buckets
    assert gpu.headroom_bytes == gpu.capacity_bytes - gpu.peak_bytes


@SETTINGS
@given(model=model_specs(), train=train_specs(), hw=hardware)
def test_phase_totals_equal_the_rows_the_budget_shows(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
) -> None:
    """The verdict comes from each stage's largest phase total (``end_stages`` adds them up
    for the end stages without building their terms, ``stages_allocated`` from the terms); the
    per-bucket rows the Budget shows must sum to them."""
    train = _fitted(model, train)
    kn = knobs(train)
    coeffs = planner.default_coefficients(train.activation_profile, hw.name)
    streaming = kn.offload_mode == "streaming"
    stages = tuple(range(train.parallel.pp))
    all_states, all_acts = stage_parts(model, kn, coeffs, stages)
    allocated = stages_allocated(all_states, all_acts, stages, kn.grad_accum, streaming)
    for stage in stages:
        t = stage_terms_from_knobs(model, kn, coeffs, stage)
        assert (t.states, t.activations) == (all_states[stage], all_acts[stage])
        rows = t.rows()
        totals = phase_totals(rows)
        assert list(totals) == [sum(row) for row in rows], stage
        largest = max(totals)
        assert allocated[stage] == (largest, totals.index(largest)), stage
    ends = (0, kn.pp - 1) if kn.pp > 1 else (0,)
    assert end_stages(model, kn, coeffs)[0] == tuple(allocated[stage] for stage in ends)
    dumped = planner.estimate(model, train, hw).model_dump()
    assert planner.BudgetModel.model_validate(dumped).model_dump() == dumped


@SETTINGS
@given(
    model=model_specs(),
    train=train_specs(),
    hw=hardware,
    micro_batch=st.integers(1, 8),
    fraction=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_evaluate_on_replaced_knobs_equals_estimate_on_the_spec(
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    micro_batch: int,
    fraction: float,
) -> None:
    """A search's knobs-level candidates give exactly what a validated spec gives."""
    train = _fitted(model, train)
    spec = _with(
        train,
        micro_batch_size=micro_batch,
        offload={**train.offload.model_dump(), "fraction": fraction},
    )
    kn = knobs(train)._replace(micro_batch=micro_batch, offload_fraction=fraction)
    assert (
        planner.evaluate(model, kn, hw).model_dump()
        == planner.estimate(model, spec, hw).model_dump()
    )


@SETTINGS
@given(model=model_specs(), train=train_specs(), hw=hardware, factor=st.floats(0.25, 4.0))
def test_never_fits_above_capacity(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware, factor: float
) -> None:
    train = _fitted(model, train)
    peak = _peak(model, train, hw)
    # Capacities around the peak, so both verdicts occur.
    sized = hw.model_copy(update={"memory_bytes": max(1, int(peak * factor))})
    budget = planner.estimate(model, train, sized)
    assert budget.gpu.peak_bytes == peak
    if budget.gpu.peak_bytes > budget.gpu.capacity_bytes:
        assert budget.fits is False
    if budget.fits:
        assert budget.gpu.peak_bytes + budget.margin_bytes <= budget.gpu.capacity_bytes
    # the preset itself
    real = planner.estimate(model, train, hw)
    if real.gpu.peak_bytes > hw.memory_bytes:
        assert real.fits is False


# --- monotonicity ------------------------------------------------------------------------


@SETTINGS
@given(
    model=model_specs(),
    train=train_specs(),
    hw=hardware,
    sizes=st.lists(st.integers(1, 16), min_size=2, max_size=2, unique=True).map(sorted),
)
def test_peak_nondecreasing_in_micro_batch_size(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware, sizes: list[int]
) -> None:
    train = _fitted(model, train)
    small, large = sizes
    assert _peak(model, _with(train, micro_batch_size=small), hw) <= _peak(
        model, _with(train, micro_batch_size=large), hw
    )


@SETTINGS
@given(
    model=model_specs(),
    train=train_specs(),
    hw=hardware,
    lengths=st.lists(st.integers(1, 16384), min_size=2, max_size=2, unique=True).map(sorted),
)
def test_peak_nondecreasing_in_seq_len(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware, lengths: list[int]
) -> None:
    train = _fitted(model, train)
    scale = train.parallel.tp if train.parallel.sequence_parallel else 1  # SP splits it
    short, long = (scale * n for n in lengths)
    assert _peak(model, _with(train, seq_len=short), hw) <= _peak(
        model, _with(train, seq_len=long), hw
    )


@SETTINGS
@given(
    model=model_specs(),
    train=train_specs(),
    hw=hardware,
    fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2).map(sorted),
)
def test_peak_nonincreasing_in_offload_fraction(
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    fractions: list[float],
) -> None:
    train = _fitted(model, _with(train, framework="none"))  # fsdp2 offloads nothing
    low, high = fractions
    peaks = [
        _peak(model, _with(train, offload={"mode": "optimizer", "fraction": f}), hw)
        for f in (0.0, low, high, 1.0)
    ]
    assert peaks == sorted(peaks, reverse=True), (fractions, peaks)


@st.composite
def non_streaming_train_specs(draw: st.DrawFn) -> planner.TrainSpec:
    train = draw(train_specs())
    if train.offload.mode == "streaming":  # streaming checkpoints every layer regardless
        train = _with(train, offload={"mode": "none"})
    return train


# Regression, found by this test: a dense first layer followed by MoE layers (DeepSeek's
# first_k_dense_replace, Qwen's mlp_only_layers). Full recompute charged an MoE layer's
# recompute block at the end of backward, where the block recomputed is the dense first layer.
_DENSE_FIRST_MOE = planner.ModelSpec(
    vocab_size=1000,
    hidden_size=64,
    num_layers=2,
    num_heads=1,
    ffn_hidden_size=64,
    moe=planner.MoESpec(num_experts=2, top_k=2, expert_ffn_size=1024, dense_first_layers=1),
)


@SETTINGS
@given(model=model_specs(), train=non_streaming_train_specs(), hw=hardware)
@example(model=_DENSE_FIRST_MOE, train=planner.TrainSpec(seq_len=64), hw=planner.gpu("H100-80GB"))
def test_peak_nonincreasing_in_recompute_strength(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware
) -> None:
    train = _fitted(model, train)
    none, selective, full = (
        _allocated(planner.estimate(model, _with(train, recompute=r), hw))
        for r in ("none", "selective", "full")
    )
    assert none >= selective, (none, selective)
    # Re-running a block holds a little more than the layers it re-runs saved (its output, the
    # checkpoint's gradient): a one-layer stage saves nothing by recompute and pays that.
    t, coeffs = stage_terms(model, _with(train, recompute="full"), hw, 0)
    rerun = int(coeffs.recompute_hidden_tensors * t.activations.layer.layer_input)
    assert full <= none + rerun, (none, full, rerun)
    # block-wise recompute with one layer per block is full recompute
    assert _allocated(planner.estimate(model, _with(train, recompute={"every_k": 1}), hw)) == full


# Found by this test: with every tensor's optimizer state offloaded (fraction 0.999 reaches
# the last tensor), ZeRO-1 still leaves an element of the router bias (3 experts over 2
# ranks) on the GPU, and with it the optimizer's temporaries for the largest tensor.
_ODD_ROUTER = planner.ModelSpec(
    vocab_size=1000,
    hidden_size=64,
    num_layers=1,
    num_heads=1,
    ffn_hidden_size=64,
    moe=planner.MoESpec(num_experts=3, top_k=1, expert_ffn_size=64, router_bias=True),
)


@SETTINGS
@given(model=model_specs(), train=train_specs(), hw=hardware, dp=st.sampled_from([2, 4, 8]))
@example(
    model=_ODD_ROUTER,
    train=planner.TrainSpec(seq_len=1, offload={"mode": "optimizer", "fraction": 0.999}),
    hw=planner.gpu("H100-80GB"),
    dp=2,
)
def test_peak_nonincreasing_in_zero_stage(
    model: planner.ModelSpec, train: planner.TrainSpec, hw: planner.Hardware, dp: int
) -> None:
    train = _fitted(model, _with(train, framework="none"))  # fsdp2 is ZeRO-3 only
    base = _with_parallel(train, dp=dp, cp=1, ep=1)
    peaks = [_peak(model, _with_parallel(base, zero_stage=z), hw) for z in range(4)]
    assert peaks[:3] == sorted(peaks[:3], reverse=True), peaks
    # ZeRO-3 gathers two whole units around compute (FSDP all-gather buffers); it pays off
    # once those are smaller than the parameters it shards away, as in any real model.
    par = base.parallel
    stages = {0, par.pp - 1}
    pays_off = all(
        2 * sp.max_unit_numel <= (sp.dense_numel + sp.expert_numel) * (1 - 1 / dp)
        for sp in (stage_params(model, par.tp, par.pp, 1, s) for s in stages)
    )
    if pays_off:
        assert peaks[3] <= peaks[2], peaks
    # Whatever the unit sizes, ZeRO-3 costs at most its gather buffers over ZeRO-2.
    z2, z3 = (planner.estimate(model, _with_parallel(base, zero_stage=z), hw) for z in (2, 3))
    assert _allocated(z3) - z3.gpu.buckets["transfer_buffers"] <= _allocated(z2), peaks
    if train.offload.mode != "streaming":
        assert z2.gpu.buckets["transfer_buffers"] == 0


def _allocated(budget: planner.Budget) -> int:
    """Bytes the caching allocator hands out at the peak (no context, no slack)."""
    overheads = ("cuda_context", "allocator_overhead")
    return sum(v for k, v in budget.gpu.buckets.items() if k not in overheads)


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_zero_stages_shrink_peak_for_real_models(name: str, dp: int) -> None:
    model = planner.load_model(name)
    hw = planner.gpu("H100-80GB")
    peaks = [
        _peak(model, planner.TrainSpec(parallel={"dp": dp, "zero_stage": z}), hw) for z in range(4)
    ]
    assert peaks == sorted(peaks, reverse=True), peaks
    assert peaks[3] < peaks[0]
