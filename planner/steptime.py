"""Predicted step time of a plan: compute, host-link traffic and the CPU optimizer, overlapped
as each placement overlaps them.

- compute: 6 FLOPs per active parameter per token (forward 2, backward 4) plus causal attention
  (6·L·d_attn·s per token), one more forward where activations are recomputed (full, every-K,
  streaming) or the attention core again (selective); over bf16 FLOP/s x efficiency.
- host link: optimizer offload moves the offloaded gradients down and updated weights up once a
  step; streaming moves every layer's weights up twice per micro-batch (forward, and backward's
  recompute) and its gradients down once; over link bandwidth x efficiency.
- CPU optimizer: offloaded parameters over the host's AdamW throughput.
- overlap: none → compute; optimizer offload → compute, then transfers and the CPU step
  overlapped with each other; streaming → the largest of the three (double-buffered streams).

The efficiencies and the CPU rate are coefficients: uncalibrated defaults until measured.
"""

from __future__ import annotations

from typing import NamedTuple

from planner.coefficients import Coefficients
from planner.estimate import Knobs, StageTerms
from planner.hardware import Hardware
from planner.model import ModelSpec
from planner.params import count_params


class StepTime(NamedTuple):
    compute_seconds: float
    transfer_seconds: float
    cpu_optimizer_seconds: float
    step_seconds: float
    tokens_per_step: int  # global: micro-batch x sequence x accumulation x data-parallel
    tokens_per_second: float


def step_time(
    model: ModelSpec, kn: Knobs, hw: Hardware, coeffs: Coefficients, terms: StageTerms
) -> StepTime:
    """Predicted time of one optimizer step for the rank described by ``terms``."""
    counts = count_params(model)
    tokens_rank = kn.micro_batch * kn.seq_len * kn.grad_accum // kn.cp
    shards = kn.tp * kn.pp
    streaming = kn.offload == "streaming"
    d_attn = model.num_heads * model.dim_per_head
    matmul = 2 * counts.per_token_active
    attention = model.num_layers * d_attn * kn.seq_len  # causal: half of 2·L·d·s per token
    flops_per_token = 3 * matmul + 6 * attention
    if streaming or kn.checkpoint_every is not None:
        flops_per_token += matmul + 2 * attention
    elif kn.selective:
        flops_per_token += 2 * attention
    compute = flops_per_token * tokens_rank / shards / (hw.bf16_flops * coeffs.compute_efficiency)

    link = hw.host_link_bytes_per_s * coeffs.host_link_efficiency
    grad_bytes = 2 if kn.bg <= 2 else 4
    if streaming:
        numel = terms.sp.dense_numel + terms.sp.expert_numel
        transferred = kn.grad_accum * numel * (2 * kn.bp + grad_bytes)
        updated_on_cpu = numel
    else:
        transferred = terms.offloaded_numel * (kn.bp + grad_bytes)
        updated_on_cpu = terms.offloaded_numel
    transfer = transferred / link
    cpu = updated_on_cpu / coeffs.cpu_optimizer_params_per_s
    step = max(compute, transfer, cpu) if streaming else compute + max(transfer, cpu)
    tokens = kn.micro_batch * kn.seq_len * kn.grad_accum * kn.dp
    return StepTime(compute, transfer, cpu, step, tokens, tokens / step if step else 0.0)
