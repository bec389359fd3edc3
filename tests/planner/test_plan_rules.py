"""Every layout a plan proposes is one its stack runs: a test per rule the search enforces.

- TP divides the attention heads and the KV heads (Megatron-Core's TransformerConfig refuses
  heads it does not divide; torchtitan's tensor-parallel plan shards whole heads), and with
  sequence parallelism each CP rank's sequence.
- PP puts a layer on every stage; under Megatron it divides the layers (a training spec names
  no first/last stage sizes); elsewhere the earlier stages take the remainder.
- CP cuts each sequence into 2 x cp equal chunks (load-balanced ring attention: Megatron's
  zigzag, torchtitan's head-tail), and is not planned for MLA.
- EP divides the experts and dp x cp.
- An interleaved schedule (vpp > 1) runs a micro-batch count the pipeline divides (Megatron-
  Core's interleaved schedule refuses any other): a 405B plan on 16,384 GPUs interleaved 7
  chunks on 2 stages with 1 micro-batch per step.
- DeepSpeed's pipeline engine runs 1F1B at ZeRO stage 1 at most.
"""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner
from headroom.planner.cluster import cluster_for_gpu, cluster_preset
from headroom.planner.layout import Layout, Planner, PlanResult


def _planner(
    model: str | dict[str, Any],
    gpus: int,
    batch: int,
    seq: int,
    per_node: int = 8,
    **train: Any,
) -> Planner:
    cl = cluster_for_gpu(planner.gpu("H100-80GB")).model_copy(update={"gpus_per_node": per_node})
    spec = planner.TrainSpec.model_validate(train)
    return Planner(planner.load_model(model), spec, cl, cl.hardware(), gpus, batch, seq)


def _listed(result: PlanResult) -> list[dict[str, Any]]:
    assert result.plan is not None
    return [result.plan, *(c.plan for c in result.runners_up if c.plan is not None)]


def test_an_interleaved_schedule_has_a_micro_batch_count_the_pipeline_divides() -> None:
    cl = cluster_preset("DGX-H100")
    model = planner.load_model("llama-3.1-405b")
    result = planner.plan(model, planner.TrainSpec(), cl, cl.hardware(), 16384, 2048, 8192)
    assert result.fits
    for spec in _listed(result):
        p = spec["parallel"]
        if p["vpp"] > 1:
            assert spec["grad_accum_steps"] % p["pp"] == 0, spec
    # every interleaved layout of a search, and every micro-batch it tries
    p = _planner("llama-3-8b", 32, 48, 4096)
    interleaved = [lay for lay in p.layouts() if lay.vpp > 1]
    assert interleaved and {lay.pp for lay in interleaved} >= {2, 4}
    for lay in interleaved:
        micro = p.micro_batches(lay.dp, lay.pp, lay.vpp)
        assert micro and all(p.batch // (lay.dp * mb) % lay.pp == 0 for mb in micro), lay
    # 1F1B keeps the micro-batches interleaving cannot run
    lay = Layout(8, 1, 4, 2, 1, 2, 1)
    assert p.micro_batches(2, 4, 1) == [1, 2, 4, 8]  # 24, 12, 6, 3 micro-batches a step
    assert p.micro_batches(lay.dp, lay.pp, lay.vpp) == [1, 2]  # 24, 12: divisible by 4


def test_tp_divides_the_heads_and_the_kv_heads() -> None:
    model = {
        "name": "kv4",
        "vocab_size": 32000,
        "hidden_size": 3072,
        "num_layers": 8,
        "num_heads": 24,
        "num_kv_heads": 4,
        "ffn_hidden_size": 8192,
    }
    p = _planner(model, 16, 32, 2048)
    tps = {lay.tp for lay in p.layouts()}
    assert tps == {1, 2, 4}  # 8 divides the node and the 24 heads, not the 4 KV heads
    assert any("num_kv_heads (4)" in why for why in p.layout_rejections)


def test_sequence_parallelism_divides_each_cp_ranks_sequence() -> None:
    p = _planner("llama-3-8b", 64, 64, 6144, per_node=16)  # 6,144 = 2^11 x 3
    lays = p.layouts()
    assert {lay.cp for lay in lays} >= {2, 4} and {lay.tp for lay in lays} >= {2, 8}
    for lay in lays:
        assert p.seq % (2 * lay.cp) == 0 if lay.cp > 1 else True, lay
        assert (p.seq // lay.cp) % lay.tp == 0, lay


def test_pp_under_megatron_divides_the_layers() -> None:
    """Llama 3.1 405B has 126 layers: an uneven split is planned for torchtitan-like stacks
    (the earlier stages take the remainder), not for Megatron."""
    free = _planner("llama-3.1-405b", 256, 512, 4096)
    assert {lay.pp for lay in free.layouts()} >= {4, 8, 16}  # 126 % 4, 8, 16 != 0
    assert all(lay.pp <= 126 for lay in free.layouts())
    megatron = _planner("llama-3.1-405b", 256, 512, 4096, framework="megatron")
    pps = {lay.pp for lay in megatron.layouts()}
    assert pps and all(126 % pp == 0 for pp in pps) and {2, 3, 6, 7} <= pps
    assert any("Megatron splits num_layers (126)" in why for why in megatron.layout_rejections)
    result = megatron.run(max_listed=3)
    assert result.fits and all(126 % s["parallel"]["pp"] == 0 for s in _listed(result))


def test_cp_cuts_the_sequence_into_2cp_chunks_and_not_under_mla() -> None:
    p = _planner("llama-3-8b", 48, 96, 3072)  # 3,072 = 2^10 x 3: cp 3 cuts it into 6 chunks
    cps = {lay.cp for lay in p.layouts()}
    assert {2, 3, 4, 6} <= cps
    assert all(lay.cp == 1 or 3072 % (2 * lay.cp) == 0 for lay in p.layouts())
    odd = _planner("llama-3-8b", 48, 96, 3000)  # 3,000 = 2^3 x 3 x 5^3
    odd_cps = {lay.cp for lay in odd.layouts()}
    assert {2, 3, 4, 5, 6} <= odd_cps and 8 not in odd_cps  # 3,000 / 16 is no integer
    assert all(lay.cp == 1 or 3000 % (2 * lay.cp) == 0 for lay in odd.layouts())
    assert {lay.cp for lay in _planner("tiny-mla", 16, 48, 2048).layouts()} == {1}


def test_ep_divides_the_experts_and_dp_x_cp() -> None:
    p = _planner("mixtral-8x7b", 48, 96, 4096)  # 8 experts
    eps = {lay.ep for lay in p.layouts()}
    assert eps == {1, 2, 4, 8}
    for lay in p.layouts():
        assert 8 % lay.ep == 0 and (lay.dp * lay.cp) % lay.ep == 0, lay


def test_deepspeed_pipelines_run_1f1b_at_zero_1() -> None:
    p = _planner("llama-3-70b", 64, 512, 4096, framework="deepspeed")
    piped = [lay for lay in p.layouts() if lay.pp > 1]
    assert piped and all(lay.vpp == 1 for lay in piped)
    assert all(p.zeros(lay.pp, lay.dp * lay.cp > 1) == (1,) for lay in piped)
    assert p.zeros(1, True) == (1, 2, 3)
    result = p.run(max_listed=5)
    assert result.fits
    for spec in _listed(result):
        if spec["parallel"]["pp"] > 1:
            assert spec["parallel"]["zero_stage"] == 1 and spec["parallel"]["vpp"] == 1


@pytest.mark.parametrize("framework", ["none", "fsdp2", "deepspeed", "megatron"])
def test_every_listed_plan_is_a_valid_spec_of_its_stack(framework: str) -> None:
    p = _planner("mixtral-8x7b", 32, 128, 4096, framework=framework)
    result = p.run(max_listed=10)
    assert result.fits, result.reason
    for spec in _listed(result):
        train = planner.TrainSpec.model_validate(spec)
        par = train.parallel
        assert par.world_size <= 32 and 8 % par.ep == 0
        if par.vpp > 1:
            assert train.grad_accum_steps % par.pp == 0
        planner.estimate(p.model, train, p.hw, p.coeffs)
