"""Predicted step time of a plan: compute, host-link traffic and the CPU optimizer, overlapped
as each placement overlaps them.

- compute: 6 FLOPs per active parameter per token (forward 2, backward 4) plus causal attention
  (6·L·d_attn·s per token), one more forward where activations are recomputed (full, every-K,
  streaming), the attention core again (selective), or the matmuls torchtitan's per-op policy
  does not keep (selective_op: a Llama block's output projection and w3, about a third of
  its matmul FLOPs; its elementwise operations are recomputed too, its attention is not);
  over bf16 FLOP/s x efficiency.
- host link: optimizer offload moves the offloaded gradients down and updated weights up once a
  step; streaming moves every layer's weights up twice per micro-batch (forward, and backward's
  recompute) and its gradients down once; over link bandwidth x efficiency.
- CPU optimizer: offloaded parameters over the host's AdamW throughput.
- overlap: none → compute; optimizer offload → compute, then transfers and the CPU step
  overlapped with each other; streaming → the largest of compute, transfers (double-buffered
  streams) and the CPU step plus the compute it cannot hide. With clipping the CPU step waits
  for the step's norm and hides the next step's first forward only; without, each unit's
  update starts as its last gradient lands and hides the last micro-batch's recompute and
  backward (the next forward waits for the embedding's update, the last to land).

The efficiencies and the CPU rate are coefficients; ``compute_efficiency``'s default is fitted
to published Megatron-LM throughput (``calibration/throughput.py``) together with the
memory-bound traffic per token and layer (``elementwise_s``) and a fixed time per layer and
pass (``layer_overhead_s``), which the plan's layout model (``planner.layout``) adds to the
compute; the ladder's price of one rank does not add them yet.
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner.activations import selective_op_matmuls
from headroom.planner.coefficients import Coefficients
from headroom.planner.estimator import Knobs, StageTerms
from headroom.planner.hardware import Hardware, compute_efficiency
from headroom.planner.model import ModelSpec
from headroom.planner.params import count_params


class StepTime(NamedTuple):
    compute_seconds: float
    transfer_seconds: float
    cpu_optimizer_seconds: float
    step_seconds: float
    tokens_per_step: int  # global: micro-batch x sequence x accumulation x data-parallel
    tokens_per_second: float


def streaming_step_seconds(
    compute: float, transfer: float, cpu: float, per_micro: float, forward: float, clip: bool
) -> float:
    """A streaming step: the largest of its compute, its transfers (double-buffered streams)
    and its CPU step plus the compute that step cannot hide. With clipping the CPU step waits
    for the step's norm and hides the next micro-batch's ``forward`` only; without, it hides
    the last micro-batch's recompute and backward (``per_micro - forward``)."""
    hidden = forward if clip else per_micro - forward
    return max(compute, transfer, cpu + compute - hidden)


def sliding_window_keys(seq_len: int, window: int | None) -> float:
    """Twice the keys a query attends to on average over ``seq_len`` positions of a causal
    layer with ``window`` (``seq_len`` itself without one): ``2·Σ min(i + 1, w) / s``."""
    if window is None or window >= seq_len:
        return float(seq_len)
    w = window
    return (w * (w + 1) + 2 * (seq_len - w) * w) / seq_len


class StepModel:
    """The step-time model of one (model, sequence length, hardware, coefficients): the
    per-model constants are resolved once, so a search prices a candidate in a few operations."""

    def __init__(
        self,
        model: ModelSpec,
        seq_len: int,
        cp: int,
        hw: Hardware,
        coeffs: Coefficients,
        causal_skip: bool = True,
    ) -> None:
        counts = count_params(model)
        d_attn = model.num_heads * model.dim_per_head
        matmul = 2 * counts.per_token_active
        # causal: half of 2·L·d·s per token where the kernel skips the masked half (flash
        # attention); eager attention computes the whole score matrix. A sliding-window layer
        # under a kernel that skips masked blocks attends min(i + 1, w) keys at position i:
        # 2w - w²/s on average, doubled as the causal s is (see ``sliding_window_keys``)
        if causal_skip:
            sliding = model.sliding_layers_between(0, model.num_layers)
            keys = sliding_window_keys(seq_len, model.sliding_window)
            attention = d_attn * ((model.num_layers - sliding) * seq_len + sliding * keys)
        else:
            attention = model.num_layers * d_attn * seq_len * 2
        self.seq_len = seq_len
        self.cp = cp
        self.flops_base = 3 * matmul + 6 * attention
        self.flops_recompute = matmul + 2 * attention
        self.flops_selective = 2 * attention
        # selective_op: the forward of the matmuls the policy recomputes (dense blocks)
        self.flops_selective_op = model.num_layers * sum(
            2 * m.in_features * m.out_features for m in selective_op_matmuls(model) if not m.kept
        )
        self.flops_per_s = hw.bf16_flops * compute_efficiency(hw, coeffs.compute_efficiency)
        self.link = hw.host_link_bytes_per_s * coeffs.host_link_efficiency
        self.cpu_rate = coeffs.cpu_optimizer_params_per_s
        # memory-bound seconds per token, layer and pass (before TP): the elementwise traffic
        # and, with eager attention, the score matrix written, read by the softmax, its output
        # written and read by the next matmul (bf16: 8 bytes per score)
        elementwise = coeffs.elementwise_bytes_per_hidden * model.hidden_size
        if not causal_skip:
            elementwise += 8 * model.num_heads * seq_len
        self.elementwise_s = elementwise / hw.memory_bandwidth_bytes_per_s
        self.layer_overhead_s = coeffs.layer_overhead_seconds
        self.num_layers = model.num_layers

    def __call__(self, settings: Knobs, stage_numel: int, offloaded_numel: int) -> StepTime:
        """Predicted time of one optimizer step of a rank holding ``stage_numel`` parameters,
        ``offloaded_numel`` of them updated on the host (optimizer offload)."""
        tokens_rank = settings.micro_batch * self.seq_len * settings.grad_accum // self.cp
        streaming = settings.offload_mode == "streaming"
        flops_per_token = self.flops_base
        if streaming or settings.checkpoint_every is not None:
            flops_per_token += self.flops_recompute
        elif settings.selective:
            flops_per_token += self.flops_selective
        elif settings.selective_op:
            flops_per_token += self.flops_selective_op
        compute = flops_per_token * tokens_rank / (settings.tp * settings.pp) / self.flops_per_s
        grad_bytes = 2 if settings.grad_bytes <= 2 else 4
        if streaming:
            per_element = 2 * settings.param_bytes + grad_bytes
            transferred = settings.grad_accum * stage_numel * per_element
            updated_on_cpu = stage_numel
        else:
            transferred = offloaded_numel * (settings.param_bytes + grad_bytes)
            updated_on_cpu = offloaded_numel
        transfer = transferred / self.link
        cpu = updated_on_cpu / self.cpu_rate
        if streaming:
            per_micro = compute / settings.grad_accum
            forward = per_micro * self.flops_recompute / flops_per_token
            step = streaming_step_seconds(
                compute, transfer, cpu, per_micro, forward, settings.clips_grad_norm
            )
        else:
            step = compute + max(transfer, cpu)
        tokens = settings.micro_batch * self.seq_len * settings.grad_accum * settings.dp
        return StepTime(compute, transfer, cpu, step, tokens, tokens / step if step else 0.0)


def step_time(
    model: ModelSpec, settings: Knobs, hw: Hardware, coeffs: Coefficients, terms: StageTerms
) -> StepTime:
    """Predicted time of one optimizer step for the rank described by ``terms``."""
    numel = terms.stage_params.dense_numel + terms.stage_params.expert_numel
    step = StepModel(model, settings.seq_len, settings.cp, hw, coeffs)
    return step(settings, numel, terms.states.offloaded_numel)
