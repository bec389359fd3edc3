"""``recompute: selective_op``, torchtitan's per-op selective checkpointing: what a layer keeps
under its policy (derived), the profiles that price it and those that refuse it, the searches
that propose it, and its recompute's FLOPs. Its traces are held in
``tests/calibration/test_torchtitan_profile.py``."""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner
from headroom.planner.activations import selective_op_layer_bytes, selective_op_matmuls
from headroom.planner.cluster import cluster_for_gpu
from headroom.planner.estimator import (
    end_stages,
    knobs,
    stage_parts,
    stage_terms_from_knobs,
    stages_allocated,
)
from headroom.planner.ladder import candidates
from headroom.planner.layout import RECOMPUTE, SELECTIVE_OP, Planner
from headroom.planner.phases import phase_totals
from headroom.planner.steptime import StepModel
from headroom.planner.trainable import check_recompute

H100 = planner.gpu("H100-80GB")
#: torchtitan's Llama 3 8B run (its train config's shape) on 8 ranks: FSDP2 as torchtitan groups it
TORCHTITAN_8B: dict[str, Any] = {
    "seq_len": 8192,
    "activation_profile": "torchtitan",
    "framework": "fsdp2",
    "fsdp2": {"groups": "split"},
    "precision": {"grads": "fp32"},
    "parallel": {"dp": 8, "zero_stage": 3},
}


def _spec(**over: Any) -> planner.TrainSpec:
    return planner.TrainSpec.model_validate(over)


def test_a_llama_block_keeps_its_input_qkv_w1_w2_and_attentions_outputs() -> None:
    """torchtitan's policy counts the block's bias-free matmuls from 1 and keeps the odd ones:
    fused Q/K/V (1), w1 (3), w2 (5); the output projection (2) and w3 (4) are recomputed. With
    flash attention the block keeps its output and an fp32 log-sum-exp per head and position,
    and under the torchtitan profile the compiled FlexAttention's queries, keys and values."""
    model = planner.load_model("llama-3-8b")
    kept = [m.kept for m in selective_op_matmuls(model)]
    assert kept == [True, False, True, False, True]
    s, b, h, f, a = 8192, 1, 4096, 14336, 32
    kv = 8 * 128  # grouped keys' (and values') width
    textbook = planner.default_coefficients("textbook")
    torchtitan = planner.default_coefficients("torchtitan")
    # input, Q/K/V, attention's output, w1, w2 (bf16), the fp32 log-sum-exp
    derived = s * b * 2 * (h + (h + 2 * kv) + h + f + h) + 4 * a * s * b
    args = (8192 // s, s, 2, False, 1, 1, False)
    assert selective_op_layer_bytes(model, textbook, *args) == derived
    with_inputs = derived + s * b * 2 * (h + 2 * kv)
    assert selective_op_layer_bytes(model, torchtitan, *args) == with_inputs
    # the stage keeps that per layer through forward (and nothing else of the layers)
    t = stage_terms_from_knobs(
        model, knobs(_spec(seq_len=s, recompute="selective_op")), textbook, 0
    )
    full = stage_terms_from_knobs(model, knobs(_spec(seq_len=s, recompute="full")), textbook, 0)
    layers = model.num_layers
    assert t.activations.activations_saved - full.activations.activations_saved == layers * (
        derived - s * b * h * 2
    )


def test_biased_projections_are_kept_and_not_counted() -> None:
    """A biased projection runs as ``aten.addmm``: in the save list, not counted as an mm. Q/K/V
    biases (Qwen2) make the output projection the first mm; a two-matrix MLP counts two."""
    qwen = planner.load_model("llama-3-8b").model_copy(update={"qkv_bias": True})
    assert [m.kept for m in selective_op_matmuls(qwen)] == [True, True, False, True, False]
    gelu = planner.load_model("gpt3-175b")
    assert gelu.linear_bias or gelu.ffn_kind == "gelu"
    bias_free = gelu.model_copy(update={"linear_bias": False, "ffn_kind": "gelu"})
    assert [m.kept for m in selective_op_matmuls(bias_free)] == [True, False, True, False]


def test_tensor_parallelism_splits_what_is_split_and_keeps_the_reductions() -> None:
    """Column-wise outputs and attention split over TP; a row-wise projection's kept output is
    the whole sequence at full width (a partial sum); with sequence parallelism the input is
    the rank's shard and both reduce-scatters' outputs are kept."""
    model = planner.load_model("llama-3-70b")
    coeffs = planner.default_coefficients("textbook")
    s, h, f, a, kv, tp = 4096, 8192, 28672, 64, 8 * 128, 8
    got = selective_op_layer_bytes(model, coeffs, 1, s, 2, False, tp, 1, True)
    expected = 2 * s * (h / tp + (h + 2 * kv) / tp + h / tp + f / tp + h + 2 * h / tp)
    assert got == expected + 4 * a * s // tp


@pytest.mark.parametrize("profile", ["hf", "runtime", "megatron"])
def test_profiles_without_its_traces_refuse_it_naming_the_profiles_that_price_it(
    profile: str,
) -> None:
    with pytest.raises(planner.SpecError) as err:
        planner.estimate(
            planner.load_model("llama-3-8b"),
            _spec(recompute="selective_op", activation_profile=profile),
            H100,
        )
    assert err.value.field == "recompute"
    assert f"the {profile} profile does not price selective_op" in str(err.value)
    assert "profiles that do: textbook, torchtitan" in str(err.value)


@pytest.mark.parametrize(
    ("model", "over", "needle"),
    [
        ("mixtral-8x7b", {"activation_profile": "textbook"}, "is an MoE model"),
        ("tiny-mla", {"activation_profile": "textbook"}, "is an MoE and MLA model"),
        ("llama-3-8b", {"parallel": {"cp": 2}}, "priced for parallel.cp 1"),
        ("llama-3-8b", {"offload": {"mode": "streaming"}}, "streaming checkpoints its own"),
    ],
)
def test_what_it_is_not_derived_for_is_refused_naming_recompute(
    model: str, over: dict[str, Any], needle: str
) -> None:
    with pytest.raises(planner.SpecError) as err:
        planner.estimate(planner.load_model(model), _spec(recompute="selective_op", **over), H100)
    assert err.value.field == "recompute" and needle in str(err.value)


def test_the_bundled_trainer_refuses_it() -> None:
    """The trainer runs no per-op policy: refused, not run as another policy."""
    from headroom.runtime.trainer import recompute_every

    for refuse in (check_recompute, recompute_every):
        with pytest.raises(planner.SpecError, match="recompute: selective_op is torchtitan's"):
            refuse(_spec(recompute="selective_op"))
    check_recompute(_spec(recompute="full"))


@pytest.mark.parametrize("profile", ["torchtitan", "textbook"])
def test_it_keeps_less_than_none_and_more_than_full(profile: str) -> None:
    model = planner.load_model("llama-3-8b")
    peaks = {
        r: planner.estimate(
            model, _spec(seq_len=8192, recompute=r, activation_profile=profile), H100
        ).gpu.buckets["activations"]
        for r in ("none", "selective_op", "full")
    }
    assert peaks["none"] > peaks["selective_op"] > peaks["full"], peaks


def test_torchtitans_8b_preset_is_about_half_what_selective_said() -> None:
    """The preset's source says selective (op): priced as the per-op policy its peak is about
    half what ``selective`` (which with flash attention keeps everything) gave."""
    run = planner.load_run("torchtitan-llama3-8b")
    assert run.train.recompute == "selective_op"
    model, gpu = planner.load_model(run.model), planner.gpu(run.gpu)
    op = planner.estimate(model, run.train, gpu)
    selective = planner.estimate(
        model, run.train.model_copy(update={"recompute": "selective"}), gpu
    )
    assert op.fits and 0.4 < op.gpu_peak_bytes / selective.gpu_peak_bytes < 0.6


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"micro_batch_size": 2, "grad_accum_steps": 4},
        {"parallel": {"dp": 8, "zero_stage": 3, "tp": 2, "sequence_parallel": True}},
        {
            "parallel": {"dp": 2, "pp": 4, "zero_stage": 0},
            "framework": "none",
            "grad_accum_steps": 8,
        },
        {"attention": "eager", "seq_len": 1024},
        {"activation_profile": "textbook", "framework": "none", "parallel": {"dp": 4}},
    ],
)
def test_the_verdict_is_the_named_terms_and_a_searchs_knobs_are_the_spec(
    over: dict[str, Any],
) -> None:
    """The verdict adds each stage's phases up without building its terms; the rows the
    Budget shows, from the named terms, sum to the same; knobs a search replaces give what
    the spec gives."""
    model = planner.load_model("llama-3-8b").model_copy(update={"num_layers": 8})
    spec = {**TORCHTITAN_8B, **over, "recompute": "selective_op"}
    train = _spec(**spec)
    kn = knobs(train)
    coeffs = planner.default_coefficients(train.activation_profile)
    stages = tuple(range(train.parallel.pp))
    all_states, all_acts = stage_parts(model, kn, coeffs, stages)
    allocated = stages_allocated(all_states, all_acts, stages, kn.grad_accum, False)
    for stage in stages:
        totals = phase_totals(stage_terms_from_knobs(model, kn, coeffs, stage).rows())
        assert allocated[stage] == (max(totals), totals.index(max(totals))), stage
    ends = (0, kn.pp - 1) if kn.pp > 1 else (0,)
    assert end_stages(model, kn, coeffs)[0] == tuple(allocated[s] for s in ends)
    searched = knobs(_spec(**{**spec, "recompute": "full"}))._replace(
        selective_op=True, checkpoint_every=None
    )
    assert (
        planner.evaluate(model, searched, H100).model_dump()
        == planner.estimate(model, train, H100).model_dump()
    )


def test_its_recompute_is_the_matmuls_the_policy_does_not_keep() -> None:
    """Step time: selective_op re-runs the output projection and w3 of every block (a third of a
    Llama 8B block's matmul FLOPs), not its attention: between no recompute and a whole
    forward again."""
    model = planner.load_model("llama-3-8b")
    price = StepModel(model, 8192, 1, H100, planner.default_coefficients("torchtitan"))
    h, f = 4096, 14336
    assert price.flops_selective_op == model.num_layers * 2 * (h * h + h * f)
    assert 0 < price.flops_selective_op < price.flops_recompute
    kn = knobs(_spec(**TORCHTITAN_8B))
    times = {
        name: price(kn._replace(**values), 10**9, 0).compute_seconds
        for name, values in {
            "none": {},
            "selective_op": {"selective_op": True},
            "full": {"checkpoint_every": 1},
        }.items()
    }
    assert times["none"] < times["selective_op"] < times["full"], times
    ratio = (times["selective_op"] - times["none"]) / (times["full"] - times["none"])
    assert 0.2 < ratio < 0.35, ratio


def test_the_ladder_proposes_it_to_the_torchtitan_profile_only() -> None:
    """torchtitan's model code runs the per-op policy, so its profile's ladder tries it, and
    for its 8B at 8k tokens on 8 H100s picks it: faster than full recompute, and none does
    not fit. Other profiles' code has no such policy to switch to."""
    model = planner.load_model("llama-3-8b")
    train = _spec(**TORCHTITAN_8B, micro_batch_size=4)

    def policies(spec: planner.TrainSpec) -> set[Any]:
        return {str(keys.get("recompute")) for _, keys in candidates(model, spec)}

    assert "selective_op" in policies(train)
    assert "selective_op" not in policies(train.model_copy(update={"activation_profile": "hf"}))
    textbook = train.model_copy(update={"activation_profile": "textbook", "framework": "none"})
    assert "selective_op" not in policies(textbook)
    with_cp = _spec(**{**TORCHTITAN_8B, "parallel": {"dp": 4, "cp": 2, "zero_stage": 3}})
    assert "selective_op" not in policies(with_cp)
    result = planner.fit(model, train, H100)
    assert result.plan is not None and result.plan["recompute"] == "selective_op"
    assert result.budget is not None and result.budget.fits
    full = [c for c in result.runners_up if c.changes.get("recompute") == "full"]
    assert full and full[0].tokens_per_second is not None
    assert result.predicted_tokens_per_second is not None
    assert result.predicted_tokens_per_second > full[0].tokens_per_second


def test_the_plan_proposes_it_to_the_torchtitan_profile_and_prices_its_step_terms() -> None:
    """The cluster plan tries the per-op policy under the torchtitan profile on layouts
    without context parallelism; its hoisted pricing equals ``step_terms`` (what --explain
    shows), and its chosen plan's memory is the estimate's."""
    cluster = cluster_for_gpu(H100)
    train = _spec(**{**TORCHTITAN_8B, "framework": "none", "parallel": {}})
    model = planner.load_model("llama-3-8b")
    p = Planner(model, train, cluster, cluster.hardware(), 16, 64, 8192)
    assert RECOMPUTE[SELECTIVE_OP][0] == "selective_op"
    layouts = p.layouts()
    assert {SELECTIVE_OP in p.recomputes(lay) for lay in layouts} == {True, False}
    assert all((SELECTIVE_OP in p.recomputes(lay)) == (lay.cp == 1) for lay in layouts)
    textbook = Planner(
        model,
        train.model_copy(update={"activation_profile": "textbook"}),
        cluster,
        cluster.hardware(),
        16,
        64,
        8192,
    )
    assert not any(SELECTIVE_OP in textbook.recomputes(lay) for lay in layouts)
    checked = 0
    for lay in layouts[:: max(1, len(layouts) // 12)]:
        if lay.cp > 1:
            continue
        c = p.costs(lay)
        for zero in (0, 3):
            out: list[tuple[float, int]] = []
            p.price_group(lay, c, zero, "none", 0, [1, 2], (SELECTIVE_OP,), 0, out)
            for step, key in out:
                mb = [1, 2][(key >> 4) & 0xFF]
                terms = p.step_terms(lay, c, zero, "none", 0, mb, SELECTIVE_OP)
                assert step == pytest.approx(terms.step, rel=1e-12)
                full = p.step_terms(lay, c, zero, "none", 0, mb, len(RECOMPUTE) - 1)
                none = p.step_terms(lay, c, zero, "none", 0, mb, 0)
                assert none.compute < terms.compute < full.compute
                checked += 1
    assert checked >= 8
    result = p.run(max_listed=3)
    assert result.plan is not None and result.budget is not None
    chosen = planner.TrainSpec.model_validate(result.plan)
    assert (
        planner.estimate(p.model, chosen, p.hw, p.coeffs).gpu_peak_bytes
        == result.budget.gpu.peak_bytes
    )
