"""The simulated device cap: live bytes counted from real allocations, out-of-memory past the
cap, host work not counted; streaming trains under a cap the reference cannot."""

from __future__ import annotations

import gc

import pytest
import torch

from headroom import planner
from headroom.runtime.cap import DeviceCap, host
from headroom.runtime.trainer import RunConfig, train_model


def test_live_bytes_follow_allocations_and_frees() -> None:
    with DeviceCap(10_000_000) as cap:
        a = torch.zeros(1000, dtype=torch.float32)
        assert cap.live_bytes == 4000
        view = a[10:20].view(2, 5)
        a.add_(1)
        assert cap.live_bytes == 4000  # views and in-place results allocate nothing
        b = a * 2
        assert cap.live_bytes == 8000
        del b
        gc.collect()
        assert cap.live_bytes == 4000 and cap.peak_bytes == 8000
        with host():
            h = torch.zeros(5000)
            h2 = h[:100] * 1
        assert cap.live_bytes == 4000  # host-side work is not the device's
        _ = h[:10].clone()
        assert cap.live_bytes == 4040  # a device copy of host data is
        del view, h2


def test_an_allocation_past_the_cap_is_an_out_of_memory_error() -> None:
    with DeviceCap(4096) as cap:
        a = torch.zeros(512, dtype=torch.float64)  # 4096 bytes: exactly the cap
        with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 4 bytes"):
            torch.zeros(1, dtype=torch.float32)
        assert cap.failed_request == (4, 4096)
        del a


def _peak(train: planner.TrainSpec, cap_bytes: int = 2**40) -> int:
    spec = planner.load_model("tiny-dense")
    with DeviceCap(cap_bytes) as cap:
        train_model(spec, train, RunConfig(steps=2))
    return cap.peak_bytes


def test_streaming_trains_under_a_cap_the_reference_cannot_fit() -> None:
    base = {"micro_batch_size": 2, "seq_len": 32}
    reference = planner.TrainSpec(**base)
    streaming = planner.TrainSpec(**base, offload={"mode": "streaming", "checkpoint_every": 1})
    ref_peak, stream_peak = _peak(reference), _peak(streaming)
    # the model states dominate a tiny model: streaming keeps them on the host
    assert stream_peak * 2 < ref_peak
    cap = (ref_peak + stream_peak) // 2
    spec = planner.load_model("tiny-dense")
    with pytest.raises(torch.OutOfMemoryError), DeviceCap(cap):
        train_model(spec, reference, RunConfig(steps=2))
    with DeviceCap(cap) as c:
        result = train_model(spec, streaming, RunConfig(steps=2))
    assert len(result.losses) == 2 and c.peak_bytes <= cap


def test_the_cap_counts_what_the_trainer_holds_on_the_device() -> None:
    """Reference fp32 training: after step 1 the device holds the parameters and both AdamW
    moments (4 + 8 bytes per parameter); the peak adds gradients and activations."""
    spec = planner.load_model("tiny-dense")
    n = planner.count_params(spec).total
    train = planner.TrainSpec(micro_batch_size=1, seq_len=8)
    peak = _peak(train)
    assert 16 * n <= peak < 16 * n * 1.5


def test_streaming_holds_only_its_pool_between_steps() -> None:
    """A micro-batch's tensors (checkpoints, the embedding gradient, the last layer's gradient)
    die with it: after each step the device holds the buffer pool and nothing else, so every
    step peaks where the first does."""
    from headroom.runtime.probe import MemoryProbe

    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(
        micro_batch_size=2, seq_len=32, offload={"mode": "streaming", "checkpoint_every": 2}
    )
    with DeviceCap(2**40) as cap:
        probe = MemoryProbe(torch.device("cpu"), cap)
        train_model(spec, train, RunConfig(steps=3), on_phase=probe)
    snaps = probe.snapshots
    pool = snaps[0]["allocated_bytes"]
    assert snaps[0]["phase"] == "placement" and pool > 0
    assert [s["allocated_bytes"] for s in snaps if s["phase"] == "optimizer"] == [pool] * 3
    for phase in ("forward", "backward"):
        peaks = {s["allocated_peak_bytes"] for s in snaps if s["phase"] == phase}
        assert len(peaks) == 1, (phase, peaks)


@pytest.mark.parametrize("tied", [False, True])
def test_streaming_runs_the_loss_on_the_pool_without_a_copy_of_the_head(tied: bool) -> None:
    """When the loss is computed (before its backward) the device holds the pool, the
    checkpoints, the head's input and saved tensors, and the kept log-probabilities: here all
    of those beside the pool are far smaller than the head's weights, so a copy of the head
    (or of the tied embedding) would show as a whole table more."""
    from headroom.runtime.probe import MemoryProbe

    spec = planner.load_model("tiny-dense").model_copy(
        update={"vocab_size": 4096, "hidden_size": 64, "tied_embeddings": tied}
    )
    train = planner.TrainSpec(
        micro_batch_size=1, seq_len=8, offload={"mode": "streaming", "checkpoint_every": 1}
    )
    table = spec.vocab_size * spec.hidden_size * 4  # fp32: the head's (or embedding's) bytes
    with DeviceCap(2**40) as cap:
        probe = MemoryProbe(torch.device("cpu"), cap)
        result = train_model(spec, train, RunConfig(steps=2), on_phase=probe)
    pool = result.placement["device_buffer_bytes"] * result.placement["num_buffers"]
    assert result.placement["device_buffer_bytes"] >= table  # the table is the largest unit
    loss_time = [s["allocated_bytes"] for s in probe.snapshots if s["phase"] == "forward"]
    assert len(loss_time) == 2
    logits = train.micro_batch_size * train.seq_len * spec.vocab_size * 4
    for live in loss_time:
        assert pool + logits <= live < pool + logits + table // 4, (live - pool - logits, table)
