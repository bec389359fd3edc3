"""A resident run follows the spec the planner reads: recompute keeps only block inputs and
trains identically; mixed precision keeps fp32 master weights and moments on the device."""

from __future__ import annotations

import pytest
import torch

from headroom import planner
from headroom.runtime.cap import DeviceCap
from headroom.runtime.probe import MemoryProbe
from headroom.runtime.trainer import RunConfig, recompute_every, train_model


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_recompute_trains_identically_and_holds_less(model: str) -> None:
    spec = planner.load_model(model)
    peaks, results = {}, {}
    for policy in ("none", "selective", {"every_k": 2}, "full"):
        train = planner.TrainSpec(micro_batch_size=2, seq_len=32, recompute=policy)
        with DeviceCap(1 << 34) as cap:
            results[str(policy)] = train_model(spec, train, RunConfig(steps=3))
        peaks[str(policy)] = cap.peak_bytes
    base = results["none"]
    for result in results.values():
        assert result.losses == base.losses
        for name, want in base.state.items():
            assert torch.equal(result.state[name], want), name
    # selective recomputes attention scores, which SDPA never stores: nothing changes
    assert peaks["selective"] == peaks["none"]
    assert peaks["full"] < peaks["{'every_k': 2}"] < peaks["none"]


def test_recompute_reads_the_spec_as_the_planner_does() -> None:
    assert recompute_every(planner.TrainSpec()) is None
    assert recompute_every(planner.TrainSpec(recompute="selective")) is None
    assert recompute_every(planner.TrainSpec(recompute="full")) == 1
    assert recompute_every(planner.TrainSpec(recompute={"every_k": 3})) == 3


def test_mixed_precision_keeps_fp32_master_and_moments_on_the_device() -> None:
    spec = planner.load_model("tiny-dense")
    numel = planner.count_params(spec).total
    train = planner.TrainSpec(micro_batch_size=1, seq_len=16)  # bf16 weights, fp32 master
    assert train.precision.master == "fp32"
    cap = DeviceCap(1 << 34)
    probe = MemoryProbe(torch.device("cpu"), cap)
    with cap:
        result = train_model(spec, train, RunConfig(steps=2, dtype=torch.bfloat16), probe)
    assert result.placement["mode"] == "none" and result.placement["master"] == "fp32"
    placement = next(s for s in probe.snapshots if s["phase"] == "placement")
    # bf16 weights 2 B + fp32 master 4 B + fp32 moments 8 B per parameter, nothing else
    assert placement["allocated_bytes"] == 14 * numel
    reference = train_model(spec, train, RunConfig(steps=2, dtype=torch.bfloat16, reference=True))
    assert reference.placement["mode"] == "none" and reference.placement["reference"] is True
    # torch.optim.AdamW keeps its moments in the working precision and no master copy
    assert reference.placement["precision"] == {
        "params": "bf16",
        "grads": "bf16",
        "master": "none",
        "optimizer_states": "bf16",
    }
