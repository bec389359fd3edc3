"""torch's context-parallel attention backward, as torchtitan runs it, traced on a CPU.

torchtitan's context parallelism (``parallelism.context_parallel_degree``) runs torch's
``context_parallel`` (``torch.distributed.tensor.experimental``): each rank's SDPA call becomes
a ring over the CP group, ``_templated_ring_attention`` forward and
``_templated_ring_attention_backward`` backward. In its backward, beside what one attention's
backward makes anyway (the queries', keys' and values' gradients in their dtype), torch 2.13's
code (``_context_parallel/_attention.py``) holds:

- every CP rank's keys and values, all-gathered once (``_AllGatherRotater``, torchtitan's
  default ``context_parallel_rotate_method = "allgather"``), and the local pair concatenated to
  send (``next_kv = torch.cat([key.flatten(), value.flatten()])``);
- the queries', keys' and values' gradients accumulated in fp32 (``accum_dtype =
  torch.float32 if _cp_options.convert_to_f32``, its default);
- the keys' and values' fp32 gradients rotated to the next rank (``_AllToAllRotater``): the
  concatenation sent and the one received.

``trace_ring_backward`` runs that function itself under fake tensors on a fake process group
of ``cp`` ranks, with PyTorch's memory tracker, and with the one thing a CPU cannot run
replaced by what the GPU's kernel allocates: the flash attention backward of each ring step,
whose outputs are the three gradients in the inputs' dtype (``_scaled_dot_product_flash_
attention_backward``). The planner's term (``planner.activations.ring_attention_backward``)
is checked against it (``tests/calibration/test_ring_attention.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from headroom.calibration.loss_traces import _exact_sizes, _total


@contextlib.contextmanager
def cp_group(cp: int) -> Iterator[Any]:
    """Rank 0 of a fake process group of ``cp`` ranks, for the block's duration (refused when
    a process group exists): its collectives move nothing, their outputs' shapes are real."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists: a ring attention trace needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _flash_backward_as_on_a_gpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: object
) -> tuple[torch.Tensor, ...]:
    """What a ring step's flash attention backward allocates on a GPU: the queries', keys' and
    values' gradients in their dtype."""
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))


def trace_ring_backward(
    tokens: int, heads: int, head_dim: int, cp: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """The most bytes torch's ring attention backward holds at once on one rank beyond its
    inputs (the local queries, keys, values, output, log-sum-exp and output gradient) and the
    three gradients a plain attention backward returns: ``tokens`` local positions, ``heads``
    local heads of ``head_dim`` (keys and values repeated to the queries' heads, as
    torchtitan's Llama does before SDPA), ``cp`` ranks."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    with _exact_sizes(), cp_group(cp) as group, FakeTensorMode():
        shape = (1, heads, tokens, head_dim)  # SDPA's [batch, heads, sequence, dim]
        tracker = MemTracker()
        with tracker:
            q, k, v, out, grad_out = (torch.empty(shape, dtype=dtype) for _ in range(5))
            lse = torch.empty((1, heads, tokens), dtype=torch.float32)
            start = _total(tracker, "current")
            grads = _attention._templated_ring_attention_backward(
                group,
                2,
                _flash_backward_as_on_a_gpu,
                grad_out,
                "grad_out",
                q,
                k,
                v,
                out,
                lse,
                is_causal=True,
            )
            peak = _total(tracker, "peak") - start
    returned = sum(g.numel() * g.element_size() for g in grads[:3])
    return peak - returned
