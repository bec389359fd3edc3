"""Pipeline schedules as inputs (``planner/schedules.py``): what each holds in flight is what
torch's own schedules order, its bubble, the micro-batch counts each runs, and the estimate,
the step and the plan each follow the named schedule."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _ComputationType

from headroom import planner
from headroom.planner.cluster import cluster_for_gpu
from headroom.planner.constraints import PlanConstraints
from headroom.planner.errors import SpecError
from headroom.planner.layout import price_spec
from headroom.planner.schedules import (
    PRICED,
    SCHEDULES,
    bubble_micro_batches,
    in_flight,
    micro_batch_rule,
)
from headroom.planner.stack_configs import from_texts
from headroom.planner.stage import v_chunks


def _torch_orders(name: str, pp: int, vpp: int, m: int) -> dict[int, list[Any]]:
    """torch's action order of every rank, as the schedule's constructor makes it (without
    the stages and process group its constructor needs, which the order does not read)."""
    cls = torch_schedules.get_schedule_class(name)
    sched = cls.__new__(cls)
    sched.pp_group_size = pp
    sched._n_microbatches = m
    sched.n_local_stages = vpp
    sched._stages = [None] * vpp
    sched._num_stages = sched.num_stages = pp * vpp
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return {rank: sched._calculate_single_rank_operations(rank) for rank in range(pp)}


def _peak_chunks(actions: list[Any]) -> int:
    """The most chunk activations alive at once: from a forward to its full backward, or to
    its weights' backward where the backward is split (its input backward keeps the graph)."""
    alive: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        if action is None:
            continue
        key = (action.stage_index, action.microbatch_index)
        kind = action.computation_type
        if kind == _ComputationType.FORWARD:
            alive.add(key)
            peak = max(peak, len(alive))
        elif kind in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT):
            alive.discard(key)
    return peak


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"])
def test_in_flight_is_what_torchs_schedules_order(name: str) -> None:
    checked = 0
    for pp in (2, 3, 4, 8):
        for vpp in (1, 2, 3, 4):
            for m in range(1, 3 * pp + 2):
                if micro_batch_rule(name, pp, vpp, m) is not None:
                    continue  # torch refuses the count
                orders = _torch_orders(name, pp, vpp, m)
                for stage in range(pp):
                    chunks = _peak_chunks(orders[stage])
                    expected = -(-chunks // vpp)
                    assert in_flight(pp, vpp, stage, m, name) == expected, (pp, vpp, m, stage)
                    checked += 1
    assert checked > 500


def test_single_stage_schedules_hold_what_their_loops_hold() -> None:
    """torch's Schedule1F1B warms up ``min(m, pp - stage)`` forwards; ScheduleGPipe runs every
    forward before any backward (their ``_step_microbatches``)."""
    assert [in_flight(4, 1, s, 16, "1F1B") for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, 1, s, 2, "1F1B") for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(4, 1, s, 16, "GPipe") for s in range(4)] == [16] * 4
    # no schedule named: 1F1B, or Megatron's interleaved 1F1B
    assert in_flight(4, 1, 0, 16) == 4
    assert in_flight(4, 2, 0, 16) == -(-(2 * 3 + 4 + 1) // 2)


def test_the_bubble_of_each_schedule() -> None:
    assert bubble_micro_batches(8, 1, "1F1B") == bubble_micro_batches(8, 1, "GPipe") == 7
    assert bubble_micro_batches(8, 2, "Interleaved1F1B") == 3.5
    assert bubble_micro_batches(8, 2, "LoopedBFS") == 3.5
    assert bubble_micro_batches(8, 2, "InterleavedZeroBubble") == pytest.approx(7 / 6)


def test_the_micro_batch_counts_each_schedule_runs() -> None:
    # torch's 1F1B: at least pp; its interleaved schedules: a count a round divides
    assert micro_batch_rule("1F1B", 4, 1, 3) is not None
    assert micro_batch_rule("1F1B", 4, 1, 4) is None
    assert micro_batch_rule("Interleaved1F1B", 4, 2, 10) is None  # 2 rounds of 5
    assert "rounds" in (micro_batch_rule("Interleaved1F1B", 4, 2, 9) or "")
    assert micro_batch_rule("InterleavedZeroBubble", 4, 2, 3) is None  # one round
    # Megatron's interleaved schedule (none named): a count pp divides
    assert "Megatron" in (micro_batch_rule(None, 4, 2, 10) or "")
    assert micro_batch_rule(None, 4, 2, 12) is None
    assert micro_batch_rule("GPipe", 4, 1, 1) is None


def _train(**parallel: Any) -> dict[str, Any]:
    return {
        "seq_len": 4096,
        "micro_batch_size": 1,
        "grad_accum_steps": 16,
        "parallel": {"pp": 4, "dp": 2, **parallel},
    }


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"framework": "megatron", "parallel": {"pp_schedule": "GPipe"}}, "allowed: 1F1B"),
        (
            {"framework": "deepspeed", "parallel": {"pp_schedule": "Interleaved1F1B"}},
            "allowed: 1F1B, got Interleaved1F1B",
        ),
        ({"parallel": {"pp_schedule": "1F1B", "vpp": 2}}, "parallel.vpp must be 1"),
        ({"parallel": {"pp_schedule": "ZBVZeroBubble", "vpp": 1}}, "parallel.vpp must be 2, got 1"),
        ({"parallel": {"pp_schedule": "DualPipeV", "vpp": 4}}, "in a V, so parallel.vpp must be 2"),
        ({"framework": "megatron", "parallel": {"pp_schedule": "DualPipeV", "vpp": 2}}, "allowed"),
    ],
)
def test_a_schedule_the_stack_does_not_run_is_refused_naming_it(
    spec: dict[str, Any], says: str
) -> None:
    base = _train()
    zero = {"megatron": 0, "deepspeed": 1}.get(spec.get("framework", ""), 0)
    parallel = {**base["parallel"], "zero_stage": zero, **spec["parallel"]}
    train = planner.TrainSpec.model_validate({**base, **spec, "parallel": parallel})
    with pytest.raises(SpecError) as err:
        planner.estimate(planner.load_model("llama-3-8b"), train, planner.gpu("H100-80GB"))
    assert err.value.field == "parallel.pp_schedule" and says in str(err.value)


def test_an_unknown_schedule_is_refused_with_the_names() -> None:
    with pytest.raises(ValueError) as err:
        planner.TrainSpec.model_validate(_train(pp_schedule="zerobubble"))
    assert "pp_schedule" in str(err.value) and "InterleavedZeroBubble" in str(err.value)


def test_the_estimate_holds_what_the_schedule_holds() -> None:
    """GPipe holds every micro-batch on every stage; the interleaved zero-bubble schedule
    holds on the last stage what 1F1B holds on the first."""
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    peaks = {}
    for name in (None, "1F1B", "GPipe", "InterleavedZeroBubble"):
        train = planner.TrainSpec.model_validate(_train(pp_schedule=name))
        peaks[name] = planner.estimate(model, train, hw)
    assert peaks[None].gpu_peak_bytes == peaks["1F1B"].gpu_peak_bytes
    assert peaks["GPipe"].gpu_peak_bytes > 2 * peaks["1F1B"].gpu_peak_bytes
    # vpp 1: the zero-bubble schedule holds pp micro-batches on each stage (1F1B: pp on the
    # first, 1 on the last), so its peak is at least 1F1B's
    assert peaks["InterleavedZeroBubble"].gpu_peak_bytes >= peaks["1F1B"].gpu_peak_bytes


def test_the_step_prices_the_schedules_bubble() -> None:
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    cluster = cluster_for_gpu(hw)
    bubbles = {}
    for name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        train = planner.TrainSpec.model_validate(_train(pp_schedule=name, vpp=2))
        price = price_spec(model, train, cluster, hw)
        bubbles[name] = next(t for t in price.terms if t.term == "bubble")
    zb, il = bubbles["InterleavedZeroBubble"], bubbles["Interleaved1F1B"]
    assert zb.seconds == pytest.approx(il.seconds / 3, rel=1e-9)
    assert zb.inputs["pp_schedule"] == "InterleavedZeroBubble"
    assert zb.inputs["bubble_micro_batches"] == pytest.approx(3 / 6)
    # torch's 1F1B refuses fewer micro-batches than stages
    few = planner.TrainSpec.model_validate({**_train(pp_schedule="1F1B"), "grad_accum_steps": 2})
    with pytest.raises(SpecError) as err:
        price_spec(model, few, cluster, hw)
    assert err.value.field == "grad_accum_steps" and "at least parallel.pp (4)" in str(err.value)


def test_the_plan_keeps_the_named_schedule() -> None:
    """A plan of a spec naming GPipe prices every candidate as GPipe: one stage per rank, its
    memory and its bubble; one naming none may interleave."""
    model, hw = planner.load_model("llama-3-70b"), planner.gpu("H100-80GB")
    cluster = cluster_for_gpu(hw)
    spec = {"seq_len": 4096, "parallel": {"pp": 8, "pp_schedule": "GPipe"}}
    gpipe = planner.plan(model, planner.TrainSpec.model_validate(spec), cluster, hw, 64, 256, 4096)
    assert gpipe.fits and gpipe.plan is not None
    assert gpipe.plan["parallel"]["pp_schedule"] == "GPipe"
    assert gpipe.plan["parallel"]["vpp"] == 1
    assert gpipe.runners_up and all(c.parallel["vpp"] == 1 for c in gpipe.runners_up)
    bubble = next(t for t in gpipe.step if t.term == "bubble")
    assert bubble.inputs["pp_schedule"] == "GPipe"
    assert bubble.inputs["bubble_micro_batches"] == gpipe.plan["parallel"]["pp"] - 1


def test_every_schedule_is_named_and_priced() -> None:
    assert set(SCHEDULES) == set(PRICED)
    for name in SCHEDULES:
        assert torch_schedules.get_schedule_class(name).__name__.lower().endswith(name.lower())


#: a torchtitan job of 4 pipeline stages, its schedule to be named
_TITAN_TOML = """
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 8
seq_len = 4096
[parallelism]
pipeline_parallel_degree = 4
pipeline_parallel_microbatch_size = 1
pipeline_parallel_schedule = "{schedule}"
"""


@pytest.mark.parametrize(
    ("named", "schedule", "vpp"),
    [
        ("gpipe", "GPipe", None),
        ("ZBVZeroBubble", "ZBVZeroBubble", 2),
        ("DualPipeV", "DualPipeV", 2),
    ],
)
def test_torchtitans_schedules_are_priced_as_torch_runs_them(
    named: str, schedule: str, vpp: int | None
) -> None:
    """``gpipe`` every forward first; the V schedules two chunks per rank in a V."""
    found = from_texts([("llama3_8b.toml", _TITAN_TOML.format(schedule=named))])
    assert found.train["parallel"]["pp_schedule"] == schedule
    assert found.train["parallel"].get("vpp") == vpp


def _actions(action: Any) -> list[Any]:
    """An action, or the two a DualPipeV overlapped forward and backward runs (in order)."""
    if action.computation_type == _ComputationType.OVERLAP_F_B:
        return list(action.sub_actions)
    return [action]


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_the_v_schedules_hold_what_torchs_orders_hold(name: str) -> None:
    checked = 0
    for pp in (2, 3, 4, 5, 8):
        for m in range(1, 3 * pp + 2):
            if micro_batch_rule(name, pp, 2, m) is not None:
                continue  # DualPipeV refuses fewer than 2 pp
            orders = _torch_orders(name, pp, 2, m)
            for stage in range(pp):
                flat = [
                    a for action in orders[stage] if action is not None for a in _actions(action)
                ]
                chunks = _peak_chunks(flat)
                assert in_flight(pp, 2, stage, m, name) == -(-chunks // 2), (pp, m, stage)
                checked += 1
    assert checked > 60


#: a chunk's forward, input backward and weight backward take one time unit each (the
#: planner's assumption); a full backward both
_COST = {
    _ComputationType.FORWARD: 1.0,
    _ComputationType.BACKWARD_INPUT: 1.0,
    _ComputationType.BACKWARD_WEIGHT: 1.0,
    _ComputationType.FULL_BACKWARD: 2.0,
}


def _makespan(name: str, pp: int, vpp: int, m: int) -> float:
    """The step of torch's action orders: each rank runs its actions in order, each as soon as
    the rank is free and its inputs exist (a forward: the previous chunk's forward of the
    micro-batch; an input backward: its own forward and the next chunk's input backward; a
    weight backward: its input backward); sends take no time."""
    orders = _torch_orders(name, pp, vpp, m)
    chunks = pp * vpp
    queues = {
        r: [a for action in orders[r] if action is not None for a in _actions(action)]
        for r in range(pp)
    }
    done: dict[tuple[int, int, str], float] = {}
    free = dict.fromkeys(range(pp), 0.0)
    position = dict.fromkeys(range(pp), 0)
    left = sum(map(len, queues.values()))
    while left:
        moved = False
        for r in range(pp):
            while position[r] < len(queues[r]):
                a = queues[r][position[r]]
                s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == _ComputationType.FORWARD:
                    needs = [(s - 1, mb, "F")] if s > 0 else []
                    made = ["F"]
                elif kind == _ComputationType.BACKWARD_WEIGHT:
                    needs, made = [(s, mb, "I")], ["W"]
                else:  # an input or a full backward
                    needs = [(s, mb, "F")] + ([(s + 1, mb, "I")] if s < chunks - 1 else [])
                    made = ["I", "W"] if kind == _ComputationType.FULL_BACKWARD else ["I"]
                if any(n not in done for n in needs):
                    break
                end = max([free[r]] + [done[n] for n in needs]) + _COST[kind]
                free[r] = end
                for what in made:
                    done[(s, mb, what)] = end
                position[r] += 1
                left -= 1
                moved = True
        assert moved, f"{name} deadlocks at pp {pp}, vpp {vpp}, m {m}"
    return max(free.values())


@pytest.mark.parametrize(
    ("name", "vpps"),
    [
        ("Interleaved1F1B", (2, 3, 4)),
        ("LoopedBFS", (2, 3)),
        ("InterleavedZeroBubble", (2, 3, 4)),
        ("ZBVZeroBubble", (2,)),
        ("DualPipeV", (2,)),
    ],
)
def test_the_bubble_is_what_torchs_orders_leave_idle(name: str, vpps: tuple[int, ...]) -> None:
    """Run each rank's torch order with unit-time chunks: the step beyond the work
    (``m x 3 vpp`` units a rank) is the bubble, in micro-batch times of the stage."""
    checked = 0
    for pp in (2, 3, 4, 8):
        for vpp in vpps:
            for m in sorted({1, 2, pp - 1, pp, pp + 1, 3 * pp // 2, 2 * pp, 3 * pp, 4 * pp}):
                if m < 1 or micro_batch_rule(name, pp, vpp, m) is not None:
                    continue
                if name == "InterleavedZeroBubble" and m < pp:
                    continue  # not priced below a full round (the module docstring)
                idle = _makespan(name, pp, vpp, m) / (3 * vpp) - m
                assert bubble_micro_batches(pp, vpp, name, m) == pytest.approx(idle), (
                    pp,
                    vpp,
                    m,
                )
                checked += 1
    assert checked >= 12


def test_a_v_schedule_puts_the_head_on_the_first_rank() -> None:
    """ZBVZeroBubble and DualPipeV: rank 0 holds chunks 0 and 2 pp - 1, the embedding and the
    head, and runs the loss; the last rank holds the middle chunks and neither."""
    from headroom.planner.estimator import stage_peaks
    from headroom.planner.stage import stage_params

    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    assert v_chunks(32, 4, 0) == (range(0, 4), range(28, 32))
    assert v_chunks(32, 4, 3) == (range(12, 16), range(16, 20))
    first, last = stage_params(model, 1, 4, 1, 0, True), stage_params(model, 1, 4, 1, 3, True)
    assert first.has_embedding and first.has_head and first.num_layers == 8
    assert not (last.has_embedding or last.has_head) and last.num_layers == 8
    plain = planner.TrainSpec.model_validate(_train(pp_schedule="Interleaved1F1B", vpp=2))
    peaks = {}
    for name in ("ZBVZeroBubble", "DualPipeV"):
        train = planner.TrainSpec.model_validate(_train(pp_schedule=name, vpp=2))
        budget = planner.estimate(model, train, hw)
        first_peak, last_peak = stage_peaks(model, train, hw)
        assert budget.gpu.buckets["logits"] > 0  # the loss runs on the first rank
        assert first_peak.peak_bytes > last_peak.peak_bytes
        peaks[name] = first_peak.allocated_bytes
    interleaved_first, _ = stage_peaks(model, plain, hw)
    # the first rank's extra head and loss outweigh the micro-batches it holds fewer of
    assert peaks["ZBVZeroBubble"] > interleaved_first.allocated_bytes
    # DualPipeV holds 2 pp + 1 chunks on every rank, ZB-V min(2 pp, m + 1 + rank, 2 m)
    assert peaks["DualPipeV"] >= peaks["ZBVZeroBubble"]


def test_a_v_schedules_chunks_may_be_uneven_but_not_empty() -> None:
    """torch splits the layers into 2 pp chunks whether or not they divide (torchtitan's
    split points): 32 layers over 2 x 3 chunks price; 2 x 17 chunks do not exist."""
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    assert v_chunks(32, 3, 0) == (range(0, 6), range(27, 32))
    parallel = {"dp": 2, "pp_schedule": "ZBVZeroBubble", "vpp": 2}
    uneven = planner.TrainSpec.model_validate({**_train(), "parallel": {**parallel, "pp": 3}})
    assert planner.estimate(model, uneven, hw).gpu_peak_bytes > 0
    empty = planner.TrainSpec.model_validate({**_train(), "parallel": {**parallel, "pp": 17}})
    with pytest.raises(SpecError) as err:
        planner.estimate(model, empty, hw)
    assert err.value.field == "train.parallel.pp" and "2 x pp chunks" in str(err.value)


def test_the_plan_prices_a_v_schedule_with_its_count() -> None:
    """A plan naming ZBVZeroBubble tries vpp 2 only, and prices each candidate's bubble with
    its micro-batch count."""
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    cluster = cluster_for_gpu(hw)
    spec = {"seq_len": 4096, "parallel": {"pp": 4, "vpp": 2, "pp_schedule": "ZBVZeroBubble"}}
    found = planner.plan(
        model,
        planner.TrainSpec.model_validate(spec),
        cluster,
        hw,
        16,
        64,
        4096,
        constraints=PlanConstraints(pp=4),
    )
    assert found.fits and found.plan is not None
    assert found.plan["parallel"]["vpp"] == 2
    assert found.plan["parallel"]["pp_schedule"] == "ZBVZeroBubble"
    bubble = next(t for t in found.step if t.term == "bubble")
    pp, m = bubble.inputs["pp"], bubble.inputs["micro_batches"]
    assert pp > 1 and bubble.inputs["bubble_micro_batches"] == pytest.approx(
        bubble_micro_batches(pp, 2, "ZBVZeroBubble", m)
    )
    assert all(c.parallel["vpp"] == 2 for c in found.runners_up)


def test_a_v_schedule_runs_two_chunks_unless_told_and_none_without_a_pipeline() -> None:
    """Naming a V schedule gives a pipeline vpp 2; without a pipeline (pp 1) there is one
    stage, which the estimate prices as such, and a plan may choose it."""
    named = planner.TrainSpec.model_validate(_train(pp_schedule="DualPipeV"))
    assert named.parallel.vpp == 2
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    alone = planner.TrainSpec.model_validate(
        {**_train(), "parallel": {"pp": 1, "dp": 2, "pp_schedule": "ZBVZeroBubble"}}
    )
    assert alone.parallel.vpp == 1
    plain = planner.TrainSpec.model_validate({**_train(), "parallel": {"pp": 1, "dp": 2}})
    assert planner.estimate(model, alone, hw).gpu_peak_bytes == pytest.approx(
        planner.estimate(model, plain, hw).gpu_peak_bytes
    )
    cluster = cluster_for_gpu(hw)
    spec = {"seq_len": 4096, "parallel": {"pp_schedule": "DualPipeV"}}
    found = planner.plan(model, planner.TrainSpec.model_validate(spec), cluster, hw, 16, 64, 4096)
    assert found.fits and found.plan is not None
    for parallel in [found.plan["parallel"], *(c.parallel for c in found.runners_up)]:
        assert parallel["vpp"] == (2 if parallel["pp"] > 1 else 1)
