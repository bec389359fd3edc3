"""The planner's optimizer-step temporaries against torch AdamW, measured with PyTorch's memory
tracker on fake tensors (the same code runs on CUDA tensors: none of it is device-specific)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from headroom.planner.buckets import optimizer_temporary_bytes
from headroom.runtime.adam import torch_adamw

SHAPES = [(300, 200), (1000,), (128, 64), (7,)]


def _measured_temporaries(impl: str, dtype: torch.dtype) -> tuple[int, int, int]:
    """(optimizer bytes at the peak beyond the moments and step counters, numel, largest)."""
    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
        optimizer = torch_adamw(params, impl, lr=1e-3)
        tracker = MemTracker()
        tracker.track_external(*params, optimizer)
        with tracker:
            for _ in range(2):
                for p in params:
                    p.grad = torch.ones_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
    opt = sum(int(per_device.get("Optstate", 0)) for per_device in peak.values())
    numel = sum(p.numel() for p in params)
    states = 2 * numel * params[0].element_size() + 4 * len(params)  # moments + step counters
    return opt - states, numel, max(p.numel() for p in params)


@pytest.mark.parametrize("impl", ["for_loop", "foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_temporaries_are_what_torch_allocates(impl: str, dtype: torch.dtype) -> None:
    measured, numel, largest = _measured_temporaries(impl, dtype)
    size = torch.finfo(dtype).bits // 8
    predicted = optimizer_temporary_bytes("adamw", impl, numel, largest, largest, size, 0)
    # foreach also keeps a few scalars per group (bias corrections): at most 8 bytes per tensor
    assert 0 <= measured - predicted <= 8 * len(SHAPES), (impl, dtype, measured, predicted)


def test_stepped_in_backward_one_gradient_exists_at_a_time() -> None:
    """torchtune's optimizer_in_bwd (``torchtune/training/memory.py``: a post-accumulate-grad
    hook per parameter runs that parameter's own optimizer's ``step()`` and ``zero_grad()``),
    run with torch's AdamW on a small model: whenever a hook runs, the parameter it steps is
    the only one with a gradient, so at most the largest parameter's gradient exists, and
    the step's temporaries are that one tensor's (what ``optimizer_in_backward`` prices)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 64),
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 64),
        torch.nn.Linear(64, 1000),
    )
    params = list(model.parameters())
    optimizers = {p: torch_adamw([p], "foreach", lr=1e-3) for p in params}
    alive: list[int] = []
    stepped: list[torch.nn.Parameter] = []

    def step(p: torch.nn.Parameter) -> None:
        alive.append(sum(q.numel() for q in params if q.grad is not None))
        assert p.grad is not None
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)
        stepped.append(p)

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        out = model(torch.randint(0, 1000, (4, 32)))
        out.float().logsumexp(-1).sum().backward()
    assert len(stepped) == 2 * len(params)
    assert all(p.grad is None for p in params)
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
    # at each hook exactly one gradient: the stepped parameter's
    assert alive == [p.numel() for p in stepped]
    with FakeTensorMode():
        fake = torch.nn.Parameter(torch.zeros(1000, 64))
        optimizer = torch_adamw([fake], "foreach", lr=1e-3)
        tracker = MemTracker()
        tracker.track_external(fake, optimizer)
        with tracker:
            for _ in range(2):
                fake.grad = torch.ones_like(fake)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
    opt = sum(int(per_device.get("Optstate", 0)) for per_device in peak.values())
    one = optimizer_temporary_bytes("adamw", "foreach", fake.numel(), fake.numel(), 0, 4, 0)
    assert 0 <= opt - (2 * fake.numel() * 4 + 4) - one <= 8
