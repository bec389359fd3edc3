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
