"""DeepSpeed ZeRO run for real on the CPU: a transformers model stepped by DeepSpeed's own
optimizer wrappers over a ``gloo`` process group of a few ranks, and the buffers ZeRO made,
read off its objects.

DeepSpeed runs on a CPU (``DS_ACCELERATOR=cpu``; a small shared-memory communication op is
built with ninja on first use, through ``calibration.frameworks.extensions``), but no memory
tracker follows its flat buffers the way ``FSDPMemTracker`` follows FSDP2, so this probe reads
the buffers themselves after two steps: the 16-bit parameters (``bit16_groups_flat``; stage 3
``fp16_partitioned_groups_flat``), the fp32 master partition
(``single_partition_of_fp32_groups``; stage 3 ``fp32_partitioned_groups_flat``), the moments in
the wrapped optimizer's state, the reduction buckets (``ipg_buffer``; stage 3
``__ipg_bucket_flat_buffer``) and the gradient partition (stage 2 ``averaged_gradients``; stage
3 ``grad_partitions_flat_buffer``). Those are the pieces ``planner.states.deepspeed_states``
derives; ``tests/planner/test_deepspeed.py`` holds one against the other. Needs torch,
transformers and DeepSpeed (``make install``).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from headroom import planner
from headroom.calibration.frameworks import extensions


def _bytes(tensors: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list or dict of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(_bytes(t) for t in tensors.values())
    if isinstance(tensors, list | tuple):
        return sum(_bytes(t) for t in tensors)
    return 0


def _optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    return sum(_bytes(state) for state in optimizer.state.values())


def _step(deepspeed: Any, config: dict[str, Any], train: dict[str, Any]) -> dict[str, int]:
    """One training spec's two steps on the world this rank is in: the buffers ZeRO made."""
    from headroom.calibration import hf

    spec = planner.TrainSpec.model_validate(train)
    torch.manual_seed(0)
    net = hf.build(config)
    ds = spec.deepspeed
    zero: dict[str, Any] = {
        "stage": spec.parallel.zero_stage,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
        "stage3_max_live_parameters": ds.stage3_max_live_parameters,
        "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
        "contiguous_gradients": True,
    }
    if ds.overlap_comm is not None:
        zero["overlap_comm"] = ds.overlap_comm
    ds_config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": spec.max_grad_norm or 0.0,
    }
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    engine, zero_optimizer, _, _ = deepspeed.initialize(
        model=net, optimizer=optimizer, config=ds_config
    )
    found: dict[str, int] = {"reduction_buckets": 0, "backward_grads": 0}

    def in_backward(*_: Any) -> None:
        # the embedding's backward runs last: the reduction buckets of the backward and the
        # gradients autograd still holds (stage 1 keeps them until the backward's end)
        buckets = sum(_bytes(b.buffer) for b in zero_optimizer.ipg_buckets.values())
        found["reduction_buckets"] = max(found["reduction_buckets"], buckets)
        held = sum(_bytes(p.grad) for p in net.parameters() if p.grad is not None)
        found["backward_grads"] = max(found["backward_grads"], held)

    net.get_input_embeddings().register_full_backward_hook(in_backward)
    for _ in range(2):
        ids = torch.randint(0, config["vocab_size"], (spec.micro_batch_size, spec.seq_len))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if spec.parallel.zero_stage == 3:
            found["grads"] = _bytes(getattr(zero_optimizer, "grad_partitions_flat_buffer", None))
        else:
            found["grads"] = _bytes(zero_optimizer.averaged_gradients)
        engine.step()
    if spec.parallel.zero_stage == 3:
        found["params"] = _bytes(zero_optimizer.fp16_partitioned_groups_flat)
        found["master_params"] = _bytes(zero_optimizer.fp32_partitioned_groups_flat)
    else:
        found["params"] = _bytes(zero_optimizer.bit16_groups_flat)
        found["master_params"] = _bytes(zero_optimizer.single_partition_of_fp32_groups)
    found["optimizer_states"] = _optimizer_state(zero_optimizer.optimizer)
    found["elements"] = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in net.parameters()
    )
    engine.destroy()
    return found


def _rank(
    rank: int,
    world: int,
    port: int,
    config: dict[str, Any],
    trains: list[dict[str, Any]],
    out: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed

    # built (or loaded) under a lock a killed build cannot leave behind, before DeepSpeed's
    # process group would build it under torch's own lock file
    extensions.load_deepspeed_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo")
    # each spec on a model of its own, one after another in the same world
    found = [_step(deepspeed, config, train) for train in trains]
    if rank == 0:
        Path(out).write_text(repr(found))
    # every rank leaves the group before it exits: a process that exits with the group's
    # threads still running aborts ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def buffers(config: dict[str, Any], train: planner.TrainSpec, world: int = 2) -> dict[str, int]:
    """Bytes of the buffers DeepSpeed ZeRO made on rank 0 of ``world`` ranks stepping the
    transformers model of ``config`` twice under ``train`` (``framework: deepspeed``)."""
    (found,) = buffers_of(config, [train], world)
    return found


def buffers_of(
    config: dict[str, Any], trains: list[planner.TrainSpec], world: int = 2
) -> list[dict[str, int]]:
    """``buffers`` for each of ``trains`` in turn, in one world of ``world`` ranks (each spec on
    a model and engine of its own): the ranks start, import DeepSpeed and join once."""
    import ast

    from headroom.calibration import processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0")
        processes.spawn(
            _rank,
            (world, port, config, [t.model_dump() for t in trains], out),
            world,
            what="DeepSpeed ZeRO ranks (calibration.frameworks.deepspeed.buffers)",
        )
        found: list[dict[str, int]] = ast.literal_eval(Path(out).read_text())
    return found
