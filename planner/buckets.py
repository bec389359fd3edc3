"""One pure function per memory bucket: integer inputs, integer bytes out.

These are the formulas of docs/ESTIMATOR.md (each with its paper or framework source), written so
a test can check each against its source. ``planner.estimate`` composes them per rank and per phase.
"""

from __future__ import annotations

import math

# Optimizer-state elements per parameter for the element-wise optimizers.
_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
# elements per fp32 scratch of an update that stores 16-bit moments (runtime/adam.py)
STATE_CHUNK = 1 << 20


def params_bytes(numel: int, bytes_per_param: int, zero3_shards: int = 1) -> int:
    """Working-precision weights; ZeRO-3 shards them over ``zero3_shards`` ranks."""
    return -(-numel // zero3_shards) * bytes_per_param


def grads_bytes(numel: int, bytes_per_grad: int, zero2_shards: int = 1) -> int:
    """Gradients (working precision, or fp32 when accumulated in fp32); ZeRO-2 shards them."""
    return -(-numel // zero2_shards) * bytes_per_grad


def master_params_bytes(numel: int, bytes_per_master: int, zero1_shards: int = 1) -> int:
    """The fp32 master copy; ZeRO-1 shards it with the optimizer."""
    return -(-numel // zero1_shards) * bytes_per_master


def optimizer_state_bytes(
    optimizer: str,
    numel: int,
    bytes_per_state: int,
    *,
    matrix_numel: int = 0,
    adafactor_numel: int = 0,
    adam8bit_bytes: int = 0,
    zero1_shards: int = 1,
) -> int:
    """Optimizer moments for ``numel`` parameters.

    adam/adamw keep m and v; sgd_momentum one buffer; sgd none; muon one momentum buffer on
    matrices and AdamW's two moments on everything else (embeddings, head, norms); adafactor
    factored second moments (rows + cols per matrix, full size for vectors), no first moment;
    adamw_8bit one byte per moment plus an fp32 absmax per 2048-element block (bitsandbytes),
    fp32 moments for tensors under 4096 elements.
    """
    if optimizer in _MOMENTS:
        total = _MOMENTS[optimizer] * numel * bytes_per_state
    elif optimizer == "muon":
        total = matrix_numel * bytes_per_state + 2 * (numel - matrix_numel) * bytes_per_state
    elif optimizer == "adafactor":
        total = adafactor_numel * bytes_per_state
    elif optimizer == "adamw_8bit":
        total = adam8bit_bytes
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    return -(-total // zero1_shards)


def optimizer_temporary_bytes(
    optimizer: str,
    impl: str,
    numel: int,
    largest_tensor_numel: int,
    largest_matrix_numel: int,
    bytes_per_state: int,
    upcast_grad_bytes: int,
    mixed_states: bool = False,
) -> int:
    """Intermediates an optimizer step allocates on top of its state.

    Measured with PyTorch's memory tracker on ``torch.optim.AdamW`` (torch 2.13;
    ``tests/calibration/test_optimizer_temporaries.py`` holds the measurement):

    - ``foreach`` materialises ``sqrt(v) / bias_correction`` for the whole group at once: one
      state-sized temporary per element;
    - ``for_loop`` computes the same tensor by tensor, and ``sqrt(v)`` and its quotient are
      both live for a moment: two temporaries the size of the largest tensor;
    - ``fused`` kernels (PyTorch's, Apex's, DeepSpeed's) update in registers: none.

    An fp32 copy of 16-bit grads (fp32 master) is made per group (foreach) or per tensor.
    16-bit moments beside an fp32 master (``mixed_states``, DeepSeek-V3's recipe) are computed
    in fp32 and stored rounded: the bundled trainer's update keeps the new first moment in an
    fp32 scratch of up to ``STATE_CHUNK`` elements.
    Adafactor's factored statistics take two state-sized temporaries per element; Muon's
    Newton-Schulz iteration holds about five bf16 copies of the largest matrix.
    """
    if optimizer == "muon":
        return 5 * min(largest_matrix_numel, numel) * 2
    if optimizer == "adamw_8bit":
        return 0
    scope = numel if impl == "foreach" else min(largest_tensor_numel, numel)
    if optimizer in ("adam", "adamw"):
        copies = {"foreach": 1, "for_loop": 2, "fused": 0}[impl]
        scratch = 4 * min(largest_tensor_numel, numel, STATE_CHUNK) if mixed_states else 0
        return scope * (copies * bytes_per_state + upcast_grad_bytes) + scratch
    per_elem = upcast_grad_bytes + (2 * bytes_per_state if optimizer == "adafactor" else 0)
    return scope * per_elem


def ema_bytes(numel: int, zero1_shards: int = 1, bytes_per_value: int = 4) -> int:
    """An fp32 EMA copy of the weights, sharded like the master copy."""
    return -(-numel // zero1_shards) * bytes_per_value


def moe_capacity(
    tokens: int, top_k: int, num_experts: int, capacity_factor: float, imbalance: float = 1.0
) -> int:
    """Slots per expert: ``C = ceil(CF x tokens x top_k / E)`` (x the hottest-expert factor)."""
    return math.ceil(capacity_factor * imbalance * tokens * top_k / num_experts)


#: elements per slab Headroom's trainer scales its experts' outputs by the routing weights in
#: (``runtime.model``): its fp32 temporaries stay this small however many slots a layer routes
ROUTING_SLAB_ELEMENTS = 1 << 22


def routing_slabs(num_experts: int, capacity: int, width: int, limit: int) -> tuple[int, int]:
    """How an implementation that scales experts' outputs ``(E, C, width)`` by their routing
    weights a slab at a time cuts them: (experts, slots) per slab, at most ``limit`` elements
    (whole experts where one fits, else runs of one expert's slots)."""
    per_slab = max(1, limit // max(width, 1))  # slots
    if per_slab >= capacity:
        return min(num_experts, max(1, per_slab // max(capacity, 1))), capacity
    return 1, per_slab


def moe_dispatch_bytes(
    tokens: int,
    num_experts: int,
    local_experts: int,
    capacity: int,
    hidden_size: int,
    bytes_per_element: int,
) -> int:
    """One MoE layer's routing buffers: fp32 router logits ``tokens x E x 4`` plus the gathered
    inputs and the expert outputs, ``local_experts x C x D x bpe`` each."""
    return tokens * num_experts * 4 + 2 * local_experts * capacity * hidden_size * bytes_per_element


def logits_bytes(tokens: int, vocab_local: int, bytes_per_element: float) -> int:
    """Output logits and the loss's temporaries for one micro-batch."""
    return int(tokens * vocab_local * bytes_per_element)


def korthikanti_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    flash: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Korthikanti et al. 2022, bytes saved by one GPT layer in 16-bit activations:
    ``s·b·h·(34 + 5·a·s/h)``; flash attention drops the ``5·a·s/h`` term; with tensor
    parallelism ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, and sequence parallelism divides all by t.
    Kept as a closed form so tests can hold the general estimator to it."""
    scores = 0 if flash else 5 * a * s * s * b // tp
    if sequence_parallel:
        return 34 * s * b * h // tp + scores
    return 10 * s * b * h + 24 * s * b * h // tp + scores


def checkpoint_bytes(
    num_checkpoints: int, tokens: int, hidden_size: int, bytes_per_element: int
) -> int:
    """Layer inputs kept at checkpoint boundaries (full or block-wise recompute)."""
    return num_checkpoints * tokens * hidden_size * bytes_per_element


def allocator_overhead_bytes(allocated_bytes: int, fraction: float) -> int:
    """Reserved minus allocated: the caching allocator's slack and fragmentation."""
    return int(allocated_bytes * fraction)
