"""The plan search's budget: its layouts and candidates are counted from the degrees' divisor
sets before any layout is made, and a search over the budget is refused naming what narrows it;
the walk stops before it would pass its groups of candidates, or at its estimates; a search's
``check`` stops it between steps.

A body of highly divisible sizes (hidden 5,040, 2,520 layers, 5,040 experts, global batch
720,720, 1,024 GPUs of 1,008 per node) made 844,928 layouts and priced 52 million candidates
before the estimate cap applied: 87 s of CPU and 860 MiB for one request.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import pytest
from plan_bodies import worst_plan

from headroom import planner
from headroom.planner.cluster import cluster_and_gpu, cluster_for_gpu, cluster_preset
from headroom.planner.layout import PLAN_BUDGET, Layout, Planner

#: the report's body: every size highly divisible
WORST: dict[str, Any] = worst_plan()
WORST_MODEL: dict[str, Any] = WORST["model"]


class Counting(Planner):
    """A planner that counts the layouts it makes and the groups of candidates its walk
    takes on (``count``'s, before they are priced)."""

    made = 0
    walked = 0

    def layouts(self) -> list[Layout]:
        lays = super().layouts()
        self.made += len(lays)
        return lays

    def candidates(
        self, lays: list[Layout], groups: list[Any], rejected: dict[str, int]
    ) -> list[tuple[float, int]]:
        self.walked += self.count(lays)[0]
        return super().candidates(lays, groups, rejected)


def _worst(**options: Any) -> Counting:
    cluster, gpu = cluster_and_gpu(None, None, WORST["gpus_per_node"])
    return Counting(
        planner.load_model(WORST_MODEL),
        planner.TrainSpec(),
        cluster,
        gpu,
        WORST["gpus"],
        WORST["global_batch"],
        WORST["seq_len"],
        **options,
    )


def _planner(
    model: str, gpu: str, gpus: int, batch: int, seq: int, per_node: int = 8, **train: Any
) -> Counting:
    cl = cluster_for_gpu(planner.gpu(gpu)).model_copy(update={"gpus_per_node": per_node})
    spec = planner.TrainSpec.model_validate(train)
    return Counting(planner.load_model(model), spec, cl, cl.hardware(), gpus, batch, seq)


@pytest.mark.parametrize(
    ("model", "gpu", "gpus", "batch", "seq", "per_node"),
    [
        ("llama-3-8b", "H100-80GB", 16, 64, 4096, 8),
        ("mixtral-8x7b", "H200-141GB", 24, 96, 4096, 8),
        ("tiny-moe", "H100-80GB", 36, 72, 1024, 12),  # part of a node, worlds of many divisors
        ("tiny-mla", "A100-80GB", 16, 48, 2048, 8),  # no context parallelism under MLA
        ("qwen3-30b-a3b", "A100-80GB", 12, 24, 2048, 4),
    ],
)
def test_the_counted_size_is_what_the_search_makes(
    model: str, gpu: str, gpus: int, batch: int, seq: int, per_node: int
) -> None:
    p = _planner(model, gpu, gpus, batch, seq, per_node)
    size = p.size()
    assert p.made == 0  # counted, not made
    lays = p.layouts()
    assert size.layouts == len(lays) > 0
    groups: list[Any] = []
    rejected = {"model_states": 0}
    priced = p.candidates(lays, groups, rejected)
    # every candidate of every layout: priced, or its group rejected by the model-state floor
    assert size.candidates == len(priced) + rejected["model_states"]
    assert size.groups >= len(groups)
    assert p.count(lays) == (size.groups, size.candidates)


def test_groups_are_counted_as_the_search_prices_them() -> None:
    """Where the model-state floor rejects nothing, every counted group is priced."""
    p = _planner("tiny-dense", "H100-80GB", 24, 96, 1024)
    groups: list[Any] = []
    rejected = {"model_states": 0}
    p.candidates(p.layouts(), groups, rejected)
    assert rejected["model_states"] == 0
    assert p.size().groups == len(groups)


def test_a_whole_vocabulary_loss_counts_no_tensor_parallel_layout() -> None:
    p = _planner("llama-3-8b", "H100-80GB", 16, 64, 4096, loss={"impl": "fused_linear"})
    assert p.size().layouts == len(p.layouts())
    assert {lay.tp for lay in p.layouts()} == {1}


def test_the_reported_body_is_refused_before_any_layout_is_made() -> None:
    p = _worst()
    cpu = time.process_time()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(planner.SpecError) as refused:
        p.run()
    assert time.process_time() - cpu < 2.0
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024 < 100  # MiB
    assert p.made == 0 and p.walked == 0
    err = refused.value
    assert err.field == "gpus"
    message = str(err)
    # 844,928 layouts before the interleaved schedule's micro-batch rule: the interleavings
    # with no micro-batch count the pipeline divides are no layouts
    assert message.startswith("gpus: planning at most 1024 GPUs would consider 720,396 layouts")
    assert f"at most {PLAN_BUDGET.layouts:,} layouts" in message
    # what narrows it, by the request's own fields
    for named in ("fewer gpus", "gpus_per_node", "global_batch with fewer divisors (720720 has"):
        assert named in message, message
    assert "seq_len with fewer divisors (5040 has 60" in message
    assert "layers (2520 has 48: the PP degrees) or experts (5040 has 60" in message


def test_a_walk_stops_before_it_passes_its_groups() -> None:
    full = _planner("llama-3.1-405b", "H100-80GB", 1024, 2048, 8192)
    unbounded = full.run()
    assert not unbounded.truncated and full.walked > 2000
    few = PLAN_BUDGET._replace(groups=full.walked * 3 // 4)
    short = _planner("llama-3.1-405b", "H100-80GB", 1024, 2048, 8192)
    bounded = short.run(budget=few)
    assert bounded.truncated and 0 < short.walked <= few.groups
    assert f"stopped after {short.walked} groups of candidates (at most {few.groups})" in (
        bounded.reason
    )
    assert bounded.layouts_skipped > unbounded.layouts_skipped


def test_a_service_sized_budget_keeps_a_large_clusters_plan() -> None:
    """GPT-3 175B on 1,024 A100s: the plan is found within the service's 12,000 groups, its ten
    runners-up (each the best of a distinct layout) within 16,000 (the walk goes on to rule
    out the layouts left)."""
    cl = cluster_preset("DGX-A100")
    args = (planner.load_model("gpt3-175b"), planner.TrainSpec(), cl, cl.hardware(), 1024)
    full = planner.plan(*args, 1536, 2048)
    served = planner.plan(*args, 1536, 2048, budget=PLAN_BUDGET._replace(groups=12_000))
    assert served.truncated and not full.truncated
    assert served.plan == full.plan
    wider = planner.plan(*args, 1536, 2048, budget=PLAN_BUDGET._replace(groups=16_000))
    assert wider.truncated and wider.plan == full.plan
    assert [c.plan for c in wider.runners_up] == [c.plan for c in full.runners_up]


class Stop(Exception):
    pass


def _stop_after(calls: int) -> tuple[list[int], Any]:
    seen = [0]

    def check() -> None:
        seen[0] += 1
        if seen[0] >= calls:
            raise Stop

    return seen, check


def test_a_check_stops_the_plan_search_between_its_steps() -> None:
    seen, check = _stop_after(10**9)
    cl = cluster_for_gpu(planner.gpu("H100-80GB"))
    model = planner.load_model("llama-3-70b")
    result = planner.plan(model, planner.TrainSpec(), cl, cl.hardware(), 64, 512, 8192, check=check)
    assert result.fits and seen[0] > 3  # polled through the walk, not just once
    seen, check = _stop_after(3)
    with pytest.raises(Stop):
        planner.plan(model, planner.TrainSpec(), cl, cl.hardware(), 64, 512, 8192, check=check)
    assert seen[0] == 3


def test_a_check_stops_the_fit_search() -> None:
    model, hw = planner.load_model("llama-3-8b"), planner.gpu("H100-80GB")
    seen, check = _stop_after(10**9)
    assert planner.fit(model, planner.TrainSpec(), hw, check=check).fits and seen[0] > 3
    seen, check = _stop_after(2)
    with pytest.raises(Stop):
        planner.fit(model, planner.TrainSpec(), hw, check=check)
    assert seen[0] == 2


@pytest.mark.parametrize(
    "moe",
    [
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64},
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64, "dense_first_layers": 3},
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64, "layer_freq": 3},
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64, "dense_layers": [0, 4, 7, 12]},
    ],
)
def test_the_floor_reads_what_the_layouts_costs_hold(moe: dict[str, Any]) -> None:
    """``floor_costs`` (every layout, without its stages' parameters) agrees with ``costs``
    (the layouts the walk prices): the first stage's layers and the communication terms."""
    spec = {
        "name": "m",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_layers": 14,
        "num_heads": 4,
        "ffn_hidden_size": 128,
        "moe": moe,
    }
    cl = cluster_for_gpu(planner.gpu("H100-80GB"))
    p = Planner(planner.load_model(spec), planner.TrainSpec(), cl, cl.hardware(), 32, 64, 1024)
    lays = p.layouts()
    assert {lay.pp for lay in lays} >= {1, 2, 4, 8} and {lay.ep for lay in lays} >= {1, 8}
    for lay in lays:
        f, c = p.floor_costs(lay), p.costs(lay)
        assert (f.layers, f.moe_layers) == (c.layers, c.moe_layers), lay
        assert (f.tp_b, f.tp_c, f.ep_b, f.ep_c, f.pp_b, f.pp_c) == (
            c.tp_b,
            c.tp_c,
            c.ep_b,
            c.ep_c,
            c.pp_b,
            c.pp_c,
        )
        assert p.floor(lay, f) == p.floor(lay, c)
