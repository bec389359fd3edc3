"""Data parallelism for the bundled trainer: the ranks of a ``torchrun`` world.

``Ranks`` is what a placement needs to know about its world: its rank, the world size, and two
process groups: the default one for device tensors (nccl on CUDA, gloo on a CPU) and a gloo one
for host tensors (the streaming trainer's host thread reduces its pinned accumulators and
gathers its working copies there, on its own communicator, while the main thread averages the
loss on the default one). A single process is ``Ranks()``: every collective is the identity.

Sharding is per flat tensor (a parameter, or a streamed unit): ``shard(numel)`` gives each rank
one contiguous piece of ``ceil(numel / world)`` elements (the last pieces shorter, or empty);
collectives pad to ``world`` equal pieces on the fly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: the environment ``torchrun`` sets in each rank
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def torchrun_world() -> int | None:
    """The world size ``torchrun`` started this process in, or None outside torchrun."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    return int(os.environ["WORLD_SIZE"])


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    device_group: Any = None  # the default group (None with one rank)
    host_group: Any = None  # gloo, for host tensors

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def piece(self, numel: int) -> int:
        """Elements of every rank's (padded) piece of a flat tensor of ``numel``."""
        return -(-numel // self.world)

    def shard(self, numel: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of a flat tensor of ``numel``."""
        size = self.piece(numel)
        lo = min(numel, self.rank * size)
        return lo, min(numel, lo + size)

    def mean_(self, tensor: Tensor, on_host: bool = False) -> Tensor:
        """Average ``tensor`` over the ranks, in place."""
        if self.distributed:
            group = self.host_group if on_host else self.device_group
            torch.distributed.all_reduce(tensor, group=group)
            tensor.div_(self.world)
        return tensor

    def mean_float(self, value: float, device: torch.device) -> float:
        """A Python float averaged over the ranks (the default group, on ``device``)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        return float(self.mean_(t)[0])

    def sum_float(self, value: float, device: torch.device) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, group=self.device_group)
        return float(t[0])

    def reduce_scatter_mean(self, flat: Tensor) -> Tensor:
        """This rank's piece of the average of ``flat`` (a device tensor) over the ranks."""
        if not self.distributed:
            return flat
        n, size = flat.numel(), self.piece(flat.numel())
        padded = torch.zeros(size * self.world, dtype=flat.dtype, device=flat.device)
        padded[:n].copy_(flat)
        out = torch.empty(size, dtype=flat.dtype, device=flat.device)
        torch.distributed.reduce_scatter_single(out, padded, group=self.device_group)
        lo, hi = self.shard(n)
        return out[: hi - lo].div_(self.world)

    def reduce_scatter_host_(self, flat: Tensor) -> None:
        """Average a host tensor of ``world`` equal pieces over the ranks into this rank's
        piece of it, in place (the rest keeps this rank's own values)."""
        if not self.distributed:
            return
        size = flat.numel() // self.world
        out = torch.empty(size, dtype=flat.dtype)
        torch.distributed.reduce_scatter_single(out, flat, group=self.host_group)
        flat[self.rank * size : (self.rank + 1) * size].copy_(out).div_(self.world)

    def all_gather(self, out: Tensor, piece: Tensor, on_host: bool = False) -> None:
        """Every rank's ``piece`` into ``out`` (flat, ``world`` padded pieces long at most)."""
        if not self.distributed:
            out.copy_(piece)
            return
        size = self.piece(out.numel())
        padded = torch.zeros(size, dtype=piece.dtype, device=piece.device)
        padded[: piece.numel()].copy_(piece)
        full = torch.empty(size * self.world, dtype=piece.dtype, device=piece.device)
        group = self.host_group if on_host else self.device_group
        torch.distributed.all_gather_single(full, padded, group=group)
        out.copy_(full[: out.numel()])

    def gather_ints(self, value: int) -> list[int]:
        """``value`` of every rank, in rank order (host group)."""
        if not self.distributed:
            return [value]
        t = torch.zeros(self.world, dtype=torch.int64)
        t[self.rank] = value
        torch.distributed.all_reduce(t, group=self.host_group)
        return [int(v) for v in t]


def init_ranks(device: torch.device) -> Ranks:
    """Join the ``torchrun`` world (gloo on a CPU, nccl on CUDA) and make the host group; one
    process outside torchrun (or a world of one) is ``Ranks()``."""
    world = torchrun_world()
    if world is None or world == 1:
        return Ranks()
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    host_group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.new_group()
    return Ranks(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=local_rank,
        local_world=int(os.environ["LOCAL_WORLD_SIZE"]),
        device_group=dist.group.WORLD,
        host_group=host_group,
    )


def close_ranks(ranks: Ranks) -> None:
    if ranks.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
