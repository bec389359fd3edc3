"""AdamW on flat fp32 buffers, the arithmetic of ``torch.optim.AdamW`` (single-tensor path).

Runs where its tensors live: the CPU for offloaded state (pinned host buffers, processed in
cache-sized chunks), the device for the rest. Gradient clipping and accumulation enter as one
``grad_scale``; the EMA of the weights and the working-precision copy are written in the same
pass over the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headroom.planner.buckets import STATE_CHUNK  # 16-bit moments: elements per fp32 scratch

#: torch's fused AdamW kernel (CPU and CUDA), used when every state is fp32
FUSED_ADAMW = hasattr(torch, "_fused_adamw_")

CHUNK = 1 << 20  # elements per pass on the host: a few MiB of fp32, cache-friendly
DEVICE_CHUNK = 1 << 24  # on the device: fewer, larger launches (chunking allocates nothing)


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    ema_decay: float = 0.999


def torch_adamw(params: Any, optimizer_impl: str, **hyper: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` running the kernel a spec's ``optimizer_impl`` names (for_loop,
    foreach or fused)."""
    return torch.optim.AdamW(
        params, foreach=optimizer_impl == "foreach", fused=optimizer_impl == "fused", **hyper
    )


def adamw_step(
    cfg: AdamWConfig,
    step: int,
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    grad_scale: float = 1.0,
    ema: Tensor | None = None,
    working: Tensor | None = None,
) -> None:
    """One AdamW update of ``master`` in place (all flat, same length), chunk by chunk.

    ``grad`` counts ``grad_scale`` times (the clipping coefficient) and is consumed: it holds
    scratch afterwards. ``ema`` becomes ``d·ema + (1-d)·master``; ``working`` (any dtype)
    receives the updated master.

    All fp32 (the usual case): nothing is allocated; the gradient is scaled in place, as
    ``clip_grad_norm_`` does, and ``torch.optim.AdamW(fused=True)``'s kernel updates the chunk in
    one pass (without it, the same arithmetic op by op, the denominator written over the spent
    gradient), so the update holds what the planner's fused kernels hold. Otherwise (16-bit
    moments, a 16-bit gradient, or no master and 16-bit weights) the arithmetic is the same in
    fp32, as a fused kernel does it in registers: each moment is computed in fp32, stored
    rounded once, and the update uses the unrounded values. That takes an fp32 scratch of at
    most ``STATE_CHUNK`` elements per 16-bit first moment or gradient.
    """
    bias1 = 1 - cfg.beta1**step
    bias2_sqrt = math.sqrt(1 - cfg.beta2**step)
    step_size = cfg.lr / bias1
    n = master.numel()
    fp32 = torch.float32
    # fp32 state updates in place; a 16-bit first moment's new value, unrounded, and a 16-bit
    # gradient's fp32 copy each take a scratch
    if exp_avg.dtype != fp32 or grad.dtype != fp32:
        size = min(n, STATE_CHUNK)
    else:
        size = min(n, CHUNK if master.device.type == "cpu" else DEVICE_CHUNK)
    if not size:
        return
    mom = None if exp_avg.dtype == fp32 else torch.empty(size, dtype=fp32, device=master.device)
    sq = grad if grad.dtype == fp32 else torch.empty(size, dtype=fp32, device=master.device)
    fused = mom is None and sq is grad and master.dtype == exp_avg_sq.dtype == fp32 and FUSED_ADAMW
    if fused:
        # torch.optim.AdamW(fused=True)'s kernel, one pass per chunk: it reads the step count
        # from a tensor on the state's device (a fill, no host round trip)
        steps = [torch.full((), float(step), dtype=fp32, device=master.device)]
    with torch.no_grad():
        for start in range(0, n, size):
            end = min(n, start + size)
            p, m, v = master[start:end], exp_avg[start:end], exp_avg_sq[start:end]
            g = sq[start:end] if sq is grad else sq[: end - start].copy_(grad[start:end])
            if grad_scale != 1.0:
                g.mul_(grad_scale)  # as clip_grad_norm_ scales: in place, the gradient is spent
            if fused:
                torch._fused_adamw_(
                    [p], [g], [m], [v], [], steps,
                    lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay,
                    eps=cfg.eps, amsgrad=False, maximize=False,
                )  # fmt: skip
                _ema_and_working(cfg, p, start, end, ema, working)
                continue
            p.mul_(1 - cfg.lr * cfg.weight_decay)
            if mom is None:
                m_new = m.lerp_(g, 1 - cfg.beta1)
            else:
                m_new = mom[: end - start].copy_(m).lerp_(g, 1 - cfg.beta1)
                m.copy_(m_new)
            if v.dtype == fp32:
                v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
                denom = torch.sqrt(v, out=g)  # g is spent
            else:
                g.mul_(g).mul_(1 - cfg.beta2).add_(v, alpha=cfg.beta2)  # the new second moment
                v.copy_(g)
                denom = g.sqrt_()
            denom.div_(bias2_sqrt).add_(cfg.eps)
            p.addcdiv_(m_new, denom, value=-step_size)
            _ema_and_working(cfg, p, start, end, ema, working)


def _ema_and_working(
    cfg: AdamWConfig, p: Tensor, start: int, end: int, ema: Tensor | None, working: Tensor | None
) -> None:
    """Fold the updated chunk ``p`` into the EMA and the working copy while it is in cache."""
    if ema is not None:
        ema[start:end].lerp_(p if p.dtype == ema.dtype else p.float(), 1 - cfg.ema_decay)
    if working is not None:
        working[start:end].copy_(p)


def grad_norm_sq(grads: list[Tensor]) -> float:
    """The squared 2-norm of ``grads`` together, accumulated in fp32 without an fp32 copy of any
    of them (a reduction with an fp32 result reads 16-bit values as it goes), one sync."""
    if not grads:
        return 0.0
    # clip_grad_norm_'s arithmetic: the norm of the per-tensor norms
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(norms))) ** 2


def clip_coefficient(total_norm_sq: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor from an accumulated squared norm."""
    if max_norm is None:
        return 1.0
    total = math.sqrt(total_norm_sq)
    return min(1.0, max_norm / (total + 1e-6))
