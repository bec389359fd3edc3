"""What the runtime's RMSNorm keeps for backward on 16-bit activations: one fp32 copy of its
input (the variance and the scaling share it) and the normalised 16-bit tensor."""

from __future__ import annotations

import torch

from headroom import planner
from headroom.runtime.model import Norm


def test_rmsnorm_keeps_one_fp32_copy_of_its_input() -> None:
    norm = Norm(64, planner.load_model("tiny-dense"))
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = norm.to(torch.bfloat16)(x)
    hidden = [t for t in saved.values() if t.numel() == x.numel()]
    assert sorted(str(t.dtype) for t in hidden) == ["torch.bfloat16", "torch.float32"]
    out.float().sum().backward()  # and the gradient still flows to the input
    assert x.grad is not None and x.grad.shape == x.shape
