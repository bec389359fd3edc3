"""The streaming trainer's host side: its pinned state is exactly the planner's host buckets,
and its host thread bounds the gradients in flight to the two slabs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from headroom import planner
from headroom.runtime.streams import ALIGN, DelayedBackend, carve, carved_bytes
from headroom.runtime.trainer import HostWork, RunConfig, Unit, train_model

FP32 = {"params": "fp32", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}


@pytest.mark.parametrize(("model", "ema"), [("tiny-dense", "host"), ("tiny-moe", "none")])
def test_streaming_host_state_is_the_planners_host_buckets(model: str, ema: str) -> None:
    spec = planner.load_model(model)
    train = planner.TrainSpec(
        micro_batch_size=1,
        seq_len=16,
        ema=ema,
        precision=FP32,
        offload={"mode": "streaming", "checkpoint_every": 1},
    )
    backend = DelayedBackend(seed=1)
    result = train_model(spec, train, RunConfig(steps=2), backend=backend)
    budget = planner.estimate(spec, train, planner.gpu("H100-80GB"))
    predicted = sum(budget.host.buckets.values())
    measured = result.placement["host_state_bytes"]
    assert measured == backend.host_bytes
    fields = (5 if ema == "host" else 4) + 1  # per unit; one buffer for the two slabs
    padding = (spec.num_layers + 2) * fields * ALIGN
    assert predicted <= measured <= predicted + padding, (predicted, measured)


def test_carved_views_are_aligned_and_disjoint() -> None:
    fields = [("a", 3, torch.bfloat16), ("b", 5, torch.float32), ("c", 1, torch.float32)]
    buffer = torch.zeros(carved_bytes(fields), dtype=torch.uint8)
    views = carve(buffer, fields)
    assert [v.numel() for v in views.values()] == [3, 5, 1]
    starts = [v.data_ptr() - buffer.data_ptr() for v in views.values()]
    assert starts == [0, ALIGN, 2 * ALIGN] and carved_bytes(fields) == 3 * ALIGN
    views["b"].fill_(1.0)
    assert views["a"].abs().sum() == 0 and views["c"].abs().sum() == 0


class GatedBackend(DelayedBackend):
    """Copies complete only when waited on, and the host thread's waits block until opened."""

    def __init__(self) -> None:
        super().__init__(seed=0, drift=0.0)
        self.gate = threading.Event()

    def synchronize(self, event: object) -> None:
        self.gate.wait(timeout=30)
        super().synchronize(event)  # type: ignore[arg-type]


def test_a_third_gradient_waits_for_the_first_slab() -> None:
    backend = GatedBackend()
    numel = 8
    slabs = list(carve(*_slabs(numel)).values())
    units = []
    for i in range(3):
        unit = Unit(f"u{i}", ["w"], [torch.Size([numel])], [0], numel)
        unit.host = {"grad": torch.zeros(numel)}
        units.append(unit)
    grads = [torch.full((numel,), float(i + 1)) for i in range(3)]
    with HostWork(backend, slabs) as work:

        def land_all() -> None:
            for i, (unit, grad) in enumerate(zip(units, grads, strict=True)):
                work.land(i, unit, grad, torch.float32, norm=True)

        lander = threading.Thread(target=land_all)
        lander.start()
        time.sleep(0.3)
        assert backend.copies == 2  # the third landing waits: both slabs hold undrained copies
        backend.gate.set()
        lander.join(timeout=30)
        work.drain()
    assert backend.copies == 3 and backend.unwaited() == 0
    for unit, grad in zip(units, grads, strict=True):
        assert torch.equal(unit.host["grad"], grad)
    assert work.norms == {i: pytest.approx(float(g.pow(2).sum())) for i, g in enumerate(grads)}


def _slabs(numel: int) -> tuple[torch.Tensor, list[tuple[str, int, torch.dtype]]]:
    fields = [(f"slab{i}", numel, torch.float32) for i in range(2)]
    return torch.zeros(carved_bytes(fields), dtype=torch.uint8), fields


def test_a_steps_first_landing_overwrites_the_spent_accumulator() -> None:
    """The accumulator is never zeroed: a unit's first landing of a step writes it (whatever
    the spent update left there), later ones add to it, 16-bit slabs promoted exactly."""
    numel = 8
    fields = [(f"slab{i}", numel, torch.bfloat16) for i in range(2)]
    slabs = list(carve(torch.zeros(carved_bytes(fields), dtype=torch.uint8), fields).values())
    unit = Unit("u", ["w"], [torch.Size([numel])], [0], numel)
    unit.host = {"grad": torch.full((numel,), float("nan"))}  # what a spent update leaves
    a, b = torch.randn(numel).bfloat16(), torch.randn(numel).bfloat16()
    ran: list[str] = []
    with HostWork(DelayedBackend(seed=0), slabs) as work:
        work.land(0, unit, a, torch.bfloat16)
        ready = work.land(0, unit, b, torch.bfloat16, norm=True, then=lambda: ran.append("u"))
        assert ready is not None
        ready.result()
        assert torch.equal(unit.host["grad"], a.float() + b.float()) and ran == ["u"]
        assert work.norms[0] == pytest.approx(float((a.float() + b.float()).pow(2).sum()))
        work.land(0, unit, b, torch.bfloat16)  # the same step: adds
        work.drain()
        assert torch.equal(unit.host["grad"], a.float() + b.float() + b.float())
        work.new_step()
        work.land(0, unit, a, torch.bfloat16)
        work.drain()
    assert torch.equal(unit.host["grad"], a.float())
