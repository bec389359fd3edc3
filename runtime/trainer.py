"""The bundled trainer: one loop, three placements of the persistent state.

- ``none``: plain PyTorch on the device (``torch.optim.AdamW``, the spec's ``optimizer_impl``); also
  what ``--reference`` runs. With low-precision working weights and an fp32 ``precision.master``
  (mixed precision), the device keeps fp32 master weights and moments and runs the same AdamW
  as ``optimizer`` with nothing offloaded. The spec's recompute applies: blocks of
  ``checkpoint_every`` layers (full recompute: every layer) keep only their input.
- ``optimizer``: the fp32 master weights and moments of the first ``fraction`` of the parameters
  (whole tensors, in order, as Megatron's HybridDeviceOptimizer and the planner split them) live
  in (pinned) host RAM and are updated by a CPU AdamW; the rest is updated on the device.
- ``streaming``: every persistent byte lives in host RAM, packed per unit (the embedding, each
  layer, the head) in one contiguous buffer, page-locked at its exact size: the working copy,
  the fp32 master, both moments, an fp32 gradient accumulator and the optional EMA. Units are
  streamed host→device into a pool of ``offload.num_buffers`` device buffers, the next one
  prefetched while the current computes; layer inputs are checkpointed every
  ``checkpoint_every`` layers; backward recomputes each block from its checkpoint and runs
  autograd layer by layer on the streamed weights (with ``checkpoint_every`` = 1 every layer
  crosses the link twice per micro-batch: forward and backward). Gradients are evacuated
  device→host on their own stream into two pinned slabs; a host thread waits for each copy and
  moves it into the unit's accumulator while the device computes on (``HostWork``), so at most
  two gradients await evacuation. With clipping (the spec's ``max_grad_norm``) the host thread
  runs the CPU AdamW after the last micro-batch, unit by unit in the order the next forward
  loads them, with the clipping coefficient from the accumulated norm, writing the EMA and the
  new working copy in the same pass; the next step's load of a unit waits for that unit's
  update only, so the optimizer overlaps the next forward. Without clipping each unit is
  updated as its last gradient of the step lands, overlapping the backward too.

Data parallel (``RunConfig.ranks``: the ``torchrun`` world, ``runtime.dist``): rank r trains its
``micro_batch_size`` rows of each micro-batch of ``micro_batch_size x world`` sequences one
process would draw, and every placement averages the gradients over the ranks. ``none`` (torch
AdamW) all-reduces them; ``optimizer`` all-reduces the device share and reduce-scatters the
offloaded share, whose fp32 master, moments and host EMA each rank keeps for its piece of every
offloaded tensor only (ZeRO-1), all-gathering the updated weights; ``streaming`` keeps each
rank's piece of every unit's master, moments and EMA, its host thread reduce-scattering the
unit's accumulator and all-gathering its working copy around the CPU AdamW.

Losses are the mean over a step's micro-batches (and ranks). Everything runs on a CPU too
(direct copies).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from headroom.planner.estimator import knobs as planner_knobs
from headroom.planner.model import ModelSpec
from headroom.planner.train import TrainSpec
from headroom.planner.trainable import check_loss
from headroom.runtime.adam import (
    CHUNK,
    AdamWConfig,
    adamw_step,
    clip_coefficient,
    grad_norm_sq,
    torch_adamw,
)
from headroom.runtime.cap import host
from headroom.runtime.dist import Ranks
from headroom.runtime.model import (
    DecoderLayer,
    DecoderLM,
    SkipInit,
    build_model,
    loss_fn,
    rope_dim,
    rope_tables,
    synthetic_batch,
)
from headroom.runtime.streams import CpuBackend, Event, carve, carved_bytes, make_backend
from headroom.runtime.support import WORKING, Working, check_recompute, runtime_precision


@dataclass
class RunConfig:
    steps: int = 5
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0
    reference: bool = False
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    prefetch: bool = True  # streaming: copy the next unit while this one computes
    ranks: Ranks = field(default_factory=Ranks)  # the data-parallel world (one process: alone)


@dataclass
class Result:
    losses: list[float]
    steps: int
    tokens: int
    seconds: float
    placement: dict[str, Any]
    state: dict[str, Tensor]  # final fp32 master parameters by name
    ema: dict[str, Tensor] | None
    phases: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


PhaseHook = Callable[[str, int], None]
#: called after each optimizer step with (step, the step's mean loss over its micro-batches
#: and ranks): what ``headroom train --progress`` writes as the run goes
StepHook = Callable[[int, float], None]


def _no_step(step: int, loss: float) -> None:
    pass


def _noop(phase: str, step: int) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# none / reference


def tokens_per_step(train: TrainSpec, world: int) -> int:
    """Tokens one optimizer step trains on, every rank's."""
    return train.micro_batch_size * train.seq_len * train.grad_accum_steps * world


def _tokens(train: TrainSpec, cfg: RunConfig) -> int:
    """Tokens the run trained on (every rank's)."""
    return cfg.steps * tokens_per_step(train, cfg.ranks.world)


def micro_batch_tokens(
    spec: ModelSpec, train: TrainSpec, cfg: RunConfig, step: int, micro: int
) -> tuple[Tensor, Tensor]:
    """This rank's micro-batch: its rows of the micro-batch of ``micro_batch_size x world``
    sequences one process would train on (the same seed), so a data-parallel run sees exactly
    the global batch of a single process."""
    mb, ranks = train.micro_batch_size, cfg.ranks
    ids, labels = synthetic_batch(
        spec.vocab_size, mb * ranks.world, train.seq_len, step, micro, cfg.seed
    )
    if not ranks.distributed:
        return ids, labels
    rows = slice(ranks.rank * mb, (ranks.rank + 1) * mb)
    return ids[rows], labels[rows]


def _accumulate(
    model: DecoderLM,
    spec: ModelSpec,
    train: TrainSpec,
    cfg: RunConfig,
    step: int,
    on_phase: PhaseHook,
) -> float:
    """Forward and backward over the step's micro-batches with autograd on a resident model;
    gradients accumulate in ``.grad``. Returns the sum of the micro-batch losses."""
    device = torch.device(cfg.device)
    total = 0.0
    for micro in range(train.grad_accum_steps):
        ids, labels = micro_batch_tokens(spec, train, cfg, step, micro)
        loss = loss_fn(model(ids.to(device), recompute_every(train)), labels.to(device))
        on_phase("forward", step)
        (loss / train.grad_accum_steps).backward()
        on_phase("backward", step)
        total += loss.item()
    return total


def recompute_every(train: TrainSpec) -> int | None:
    """Layers per recomputed block of a resident run, as the planner reads the spec (full
    recompute is 1; ``selective`` recomputes the attention scores, which scaled-dot-product
    attention never stores, so it keeps what ``none`` keeps; torchtitan's ``selective_op`` is
    refused, naming ``recompute``, and so is another stack's loss, naming ``loss.impl``)."""
    check_recompute(train)
    check_loss(train)
    return planner_knobs(train).checkpoint_every


def _train_reference(
    spec: ModelSpec, train: TrainSpec, cfg: RunConfig, on_phase: PhaseHook, on_step: StepHook
) -> Result:
    device = torch.device(cfg.device)
    model = build_model(spec, seed=cfg.seed, dtype=cfg.dtype, device=device)
    o = cfg.optim
    optimizer = torch_adamw(
        model.parameters(),
        train.optimizer_impl,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
    )
    ema = _init_ema(model, train)
    losses: list[float] = []
    start = time.perf_counter()
    on_phase("placement", 0)
    ranks = cfg.ranks
    for step in range(1, cfg.steps + 1):
        total = _accumulate(model, spec, train, cfg, step, on_phase)
        for p in model.parameters():  # data parallel: every rank steps on the average
            if p.grad is not None:
                ranks.mean_(p.grad)
        if train.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            for n, p in model.named_parameters():
                _ema_update(ema[n], p.detach(), o.ema_decay, train.ema == "host")
        on_phase("optimizer", step)
        losses.append(ranks.mean_float(total, device) / train.grad_accum_steps)
        on_step(step, losses[-1])
    seconds = time.perf_counter() - start
    with host():
        state = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return Result(
        losses,
        cfg.steps,
        _tokens(train, cfg),
        seconds,
        {
            "mode": "none",
            "reference": cfg.reference,
            # what torch.optim.AdamW keeps: everything in the working precision, no master
            "precision": dict.fromkeys(("params", "grads", "optimizer_states"), working(cfg))
            | {"master": "none"},
            "ema": train.ema,
            "data_parallel": ranks.world,
        },
        state,
        None if ema is None else {n: t.cpu() for n, t in ema.items()},
    )


def _init_ema(model: DecoderLM, train: TrainSpec) -> dict[str, Tensor] | None:
    """The fp32 EMA of the weights where the spec puts it (``ema``: gpu or host)."""
    if train.ema == "none":
        return None
    if train.ema == "gpu":
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    with host():
        return {n: p.detach().cpu().float().clone() for n, p in model.named_parameters()}


def _ema_update(ema: Tensor, weights: Tensor, decay: float, on_host: bool) -> None:
    """``ema = decay·ema + (1-decay)·weights``: on the host from a host copy of the weights
    (16-bit over the link, upcast there), on the device without an fp32 copy of them."""
    with torch.no_grad():
        if on_host:
            with host():
                ema.lerp_(weights.reshape(ema.shape).cpu().float(), 1 - decay)
        elif weights.dtype == ema.dtype:
            ema.lerp_(weights.reshape(ema.shape), 1 - decay)
        else:  # mixed-dtype arithmetic reads the 16-bit weights as it goes
            ema.mul_(decay).add_(weights.reshape(ema.shape), alpha=1 - decay)


# ---------------------------------------------------------------------------------------------
# optimizer offload


def offload_split(numels: list[int], fraction: float) -> int:
    """How many leading tensors are offloaded: whole tensors while the offloaded count is below
    ``fraction`` of the total (``planner.stage.offloaded_numel``'s rule)."""
    if fraction <= 0:
        return 0
    if fraction >= 1:
        return len(numels)
    threshold = sum(numels) * fraction
    done = 0
    for i, n in enumerate(numels):
        if done >= threshold:
            return i
        done += n
    return len(numels)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def working(cfg: RunConfig) -> Working:
    """The run's working precision by name."""
    name = str(cfg.dtype).removeprefix("torch.")
    if name not in WORKING:
        raise ValueError(f"dtype: the trainer computes in {', '.join(WORKING)}, got {name}")
    return WORKING[name]


def torch_adamw_keeps(train: TrainSpec, cfg: RunConfig) -> bool:
    """Whether ``torch.optim.AdamW`` on the working weights keeps exactly the spec's state (no
    master copy, gradients and moments in the working precision), so a resident run is the
    reference itself; otherwise it runs the trainer's AdamW with nothing offloaded."""
    p = runtime_precision(train, working(cfg))
    return p.master == "none" and p.grads == p.params == p.optimizer_states


class FoldGrads:
    """fp32 gradient accumulation (``precision.grads`` fp32 with 16-bit weights): as autograd
    finishes each parameter's gradient, a hook adds it to the parameter's fp32 accumulator
    and zeroes it in place, so both stay allocated for the step, as the planner counts them
    (working-precision gradient + fp32 accumulator per parameter)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.acc: dict[str, Tensor] = {}
        self.handles = [
            p.register_post_accumulate_grad_hook(partial(self._fold, name)) for name, p in named
        ]

    def _fold(self, name: str, p: Tensor) -> None:
        assert p.grad is not None
        with torch.no_grad():
            grad = p.grad.reshape(-1)
            acc = self.acc.get(name)
            if acc is None:
                self.acc[name] = grad.float()
            else:
                acc.add_(grad)
            grad.zero_()

    def clear(self) -> None:
        self.acc.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _train_optimizer_offload(
    spec: ModelSpec,
    train: TrainSpec,
    cfg: RunConfig,
    on_phase: PhaseHook,
    backend: CpuBackend,
    on_step: StepHook,
) -> Result:
    """Placement ``optimizer`` (and ``none`` when the spec's state is not what torch AdamW
    keeps: an fp32 master, fp32 gradient accumulation or moments in another precision)."""
    device = torch.device(cfg.device)
    precision = runtime_precision(train, working(cfg))
    state_dtype = DTYPES[precision.optimizer_states]
    model = build_model(spec, seed=cfg.seed, dtype=cfg.dtype, device=device)
    named = list(model.named_parameters())
    fraction = train.offload.fraction if train.offload.mode == "optimizer" else 0.0
    cut = offload_split([p.numel() for _, p in named], fraction)
    o = cfg.optim
    fold = FoldGrads(named) if precision.grads != precision.params else None
    grad_dtype = torch.float32 if fold is not None else cfg.dtype
    ema_on_host = train.ema == "host"
    ranks = cfg.ranks
    # host side: fp32 master, moments and a gradient landing buffer per offloaded tensor (data
    # parallel: of this rank's piece of each, ZeRO-1 style)
    offloaded: dict[str, dict[str, Tensor]] = {}
    with host():
        for name, p in named[:cut]:
            lo, hi = ranks.shard(p.numel())
            flat = p.detach().float().reshape(-1)[lo:hi].cpu()
            offloaded[name] = {
                "master": backend.pinned(flat.numel(), torch.float32).copy_(flat),
                "m": backend.pinned(flat.numel(), state_dtype),
                "v": backend.pinned(flat.numel(), state_dtype),
                "grad": backend.pinned(flat.numel(), grad_dtype),
            }
    # device side: the fp32 master (none: the weights themselves) and the moments
    dev: dict[str, dict[str, Tensor]] = {}
    for name, p in named[cut:]:
        weights = p.data.reshape(-1)
        master = weights.to(torch.float32, copy=True) if precision.master == "fp32" else weights
        dev[name] = {
            "master": master,
            "m": torch.zeros_like(master, dtype=state_dtype),
            "v": torch.zeros_like(master, dtype=state_dtype),
        }
    ema = _init_ema(model, train)
    if ema is not None and ema_on_host and ranks.distributed:
        for name in offloaded:  # the rank's piece only, beside its master
            lo, hi = ranks.shard(ema[name].numel())
            ema[name] = ema[name].reshape(-1)[lo:hi].clone()
    losses: list[float] = []
    start = time.perf_counter()
    on_phase("placement", 0)
    try:
        for step in range(1, cfg.steps + 1):
            total = _accumulate(model, spec, train, cfg, step, on_phase)
            if fold is not None:
                grads = {name: fold.acc.get(name) for name, _ in named}
            else:
                grads = {n: None if p.grad is None else p.grad.reshape(-1) for n, p in named}
            if ranks.distributed:
                # data parallel: the device's share averaged whole, the offloaded share
                # reduce-scattered to each rank's piece
                for name, g in grads.items():
                    if g is not None:
                        grads[name] = (
                            ranks.reduce_scatter_mean(g) if name in offloaded else ranks.mean_(g)
                        )
            coef = 1.0
            if train.max_grad_norm is not None:
                if ranks.distributed:  # the pieces' squares summed over the ranks
                    whole = [g for n, g in grads.items() if g is not None and n in dev]
                    pieces = [g for n, g in grads.items() if g is not None and n in offloaded]
                    norm_sq = grad_norm_sq(whole) + ranks.sum_float(grad_norm_sq(pieces), device)
                else:
                    norm_sq = grad_norm_sq([g for g in grads.values() if g is not None])
                coef = clip_coefficient(norm_sq, train.max_grad_norm)
            # gradients of the offloaded tensors go down first, then both sides update
            # (a comprehension: no loop variable keeps a gradient alive past the step)
            events = [
                backend.d2h(offloaded[name]["grad"], g)
                for name, g in grads.items()
                if name in offloaded and g is not None
            ]
            for name, p in named[cut:]:
                d, g = dev[name], grads[name]
                if g is None:  # no gradient (DeepSeek's routing bias): skipped, as torch's is
                    continue
                if d["master"].dtype == torch.float32:
                    g = g.float()  # a 16-bit gradient's fp32 copy, one tensor at a time
                adamw_step(
                    o,
                    step,
                    d["master"],
                    g,
                    d["m"],
                    d["v"],
                    grad_scale=coef,
                    ema=None if ema is None or ema_on_host else ema[name].reshape(-1),
                    working=p.data.reshape(-1) if precision.master == "fp32" else None,
                )
                del g
            for event in events:
                backend.synchronize(event)
            uploads = []
            for name, p in named[:cut]:
                h = offloaded[name]
                if grads[name] is None:
                    continue
                with host():
                    adamw_step(
                        o,
                        step,
                        h["master"],
                        h["grad"],
                        h["m"],
                        h["v"],
                        grad_scale=coef,
                        ema=ema[name].reshape(-1) if ema is not None and ema_on_host else None,
                    )
                    weights = h["master"].to(p.dtype)
                if not ranks.distributed:
                    uploads.append(backend.h2d(p.data.reshape(-1), weights))
                    continue
                # every rank's updated piece, gathered into the working weights
                piece = torch.empty(weights.numel(), dtype=p.dtype, device=device)
                backend.wait(backend.h2d(piece, weights))
                ranks.all_gather(p.data.reshape(-1), piece)
            for event in uploads:
                backend.wait(event)
            if ema is not None:  # what the updates above did not fold in
                for name, p in named:
                    if ema_on_host and name not in offloaded:
                        source = dev[name]["master"]
                    elif not ema_on_host and name in offloaded:
                        source = p.data  # the uploaded working copy, on the device
                    else:
                        continue
                    _ema_update(ema[name], source, o.ema_decay, ema_on_host)
            grads.clear()
            if fold is not None:
                fold.clear()
            model.zero_grad(set_to_none=True)
            on_phase("optimizer", step)
            losses.append(ranks.mean_float(total, device) / train.grad_accum_steps)
            on_step(step, losses[-1])
    finally:
        if fold is not None:
            fold.remove()
    seconds = time.perf_counter() - start
    state = {}
    with host():
        for name, p in named:
            if name in offloaded:
                flat = _gathered(ranks, offloaded[name]["master"], p.numel())
            else:
                flat = dev[name]["master"]
            state[name] = flat.detach().float().cpu().reshape(p.shape).clone()
        ema_out = None
        if ema is not None:
            ema_out = {}
            for n, t in ema.items():
                p = dict(named)[n]
                if ema_on_host and n in offloaded:
                    t = _gathered(ranks, t, p.numel())
                ema_out[n] = t.cpu().reshape(p.shape)
    return Result(
        losses,
        cfg.steps,
        _tokens(train, cfg),
        seconds,
        {
            "mode": train.offload.mode,
            "fraction": fraction,
            "master": precision.master,
            "precision": precision.model_dump(),
            "ema": train.ema,
            "offloaded_tensors": cut,
            "offloaded_params": sum(p.numel() for _, p in named[:cut]),
            "total_params": sum(p.numel() for _, p in named),
            "data_parallel": ranks.world,
            "host_state_bytes": backend.host_bytes,
            "host_pinning": backend.pinning,
        },
        state,
        ema_out,
    )


def _gathered(ranks: Ranks, piece: Tensor, numel: int) -> Tensor:
    """A host tensor of ``numel`` whose ranks each hold ``piece`` (their shard), whole."""
    if not ranks.distributed:
        return piece
    out = torch.empty(numel, dtype=piece.dtype)
    ranks.all_gather(out, piece, on_host=True)
    return out


# ---------------------------------------------------------------------------------------------
# streaming


class ScheduleError(RuntimeError):
    """A device buffer was reused before its consumer released it."""


@dataclass
class Unit:
    """A block streamed as one: its parameters' names, shapes and offsets in a flat buffer."""

    name: str
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    host: dict[str, Tensor] = field(default_factory=dict)
    lo: int = 0  # data parallel: this rank's [lo, hi) of the unit, whose optimizer state it keeps
    hi: int = -1

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        return {
            n: flat[o : o + s.numel()].view(s)
            for n, s, o in zip(self.names, self.shapes, self.offsets, strict=True)
        }


class Pool:
    """``size`` device buffers; a buffer is reused only after its consumer released it."""

    def __init__(self, size: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        # NaN until a copy lands: a read that did not wait for its copy cannot pass for data
        self.buffers = [
            torch.full((numel,), float("nan"), dtype=dtype, device=device) for _ in range(size)
        ]
        self.owner: list[int | None] = [None] * size
        self.in_use = [False] * size
        self.released: list[Event | None] = [None] * size
        self.ready: list[Event | None] = [None] * size
        self.next = 0
        self.loads = 0
        self.peak_in_use = 0

    def slot_for(self, unit: int) -> int | None:
        for i, owner in enumerate(self.owner):
            if owner == unit:
                return i
        return None

    def claim(self) -> int:
        """The next buffer no consumer holds (round robin); its previous copy is forgotten."""
        size = len(self.buffers)
        for i in range(size):
            slot = (self.next + i) % size
            if not self.in_use[slot]:
                self.next = (slot + 1) % size
                self.owner[slot] = None
                return slot
        raise ScheduleError(f"all {size} device buffers are in use")


class Streamer:
    """Moves units through the pool: ``acquire`` waits for (or issues) the copy, ``release``
    records that compute on the buffer is done, ``prefetch`` issues the next copy early.

    A unit whose host copy the CPU optimizer is still rewriting has a pending ``host_ready``
    future: its next copy is issued only once that update is done."""

    def __init__(self, units: list[Unit], pool: Pool, backend: CpuBackend) -> None:
        self.units, self.pool, self.backend = units, pool, backend
        self.host_ready: dict[int, Future[None]] = {}

    def prefetch(self, unit: int) -> None:
        if self.pool.slot_for(unit) is not None:
            return
        ready = self.host_ready.pop(unit, None)
        if ready is not None:
            ready.result()
        slot = self.pool.claim()
        u = self.units[unit]
        buf = self.pool.buffers[slot][: u.numel]
        src = u.host["working"][: u.numel]
        self.pool.ready[slot] = self.backend.h2d(buf, src, self.pool.released[slot])
        self.pool.owner[slot] = unit
        self.pool.loads += 1

    def acquire(self, unit: int) -> tuple[int, Tensor]:
        self.prefetch(unit)
        slot = self.pool.slot_for(unit)
        assert slot is not None
        self.backend.wait(self.pool.ready[slot])
        self.pool.in_use[slot] = True
        self.pool.peak_in_use = max(self.pool.peak_in_use, sum(self.pool.in_use))
        return slot, self.pool.buffers[slot][: self.units[unit].numel]

    def release(self, slot: int) -> None:
        self.pool.in_use[slot] = False
        self.pool.released[slot] = self.backend.record()

    def invalidate(self) -> None:
        """Forget resident copies (their host working copies are about to change); every copy
        issued so far has completed when this returns, so none reads a half-updated unit."""
        for slot, owner in enumerate(self.pool.owner):
            if owner is not None:
                self.backend.synchronize(self.pool.ready[slot])
        self.pool.owner = [None] * len(self.pool.owner)


class HostWork:
    """The streaming trainer's host thread: it lands gradients (waits for a device→host copy
    into a pinned slab, then moves the slab into the unit's fp32 accumulator) and runs the CPU
    optimizer, in submission order, while the main thread keeps the device busy.

    At most ``slabs`` landings are in flight; slab ``i % slabs`` is reused only after the
    landing that used it before is done (the main thread waits for it), so device gradients
    awaiting evacuation never exceed ``slabs`` units (the planner's gradient slabs).

    A unit's first landing of a step writes its accumulator (a converting copy), later ones add
    to it: the accumulator is never zeroed, a pass over it saved per step."""

    def __init__(
        self,
        backend: CpuBackend,
        slabs: list[Tensor],
        reduce: Callable[[Tensor], object] | None = None,
    ) -> None:
        self.backend = backend
        self.slabs = slabs
        self.reduce = reduce  # data parallel: a unit's accumulator averaged over the ranks
        # into the rank's piece of it (reduce-scatter)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headroom-host")
        self.landings: list[Future[None]] = []
        self.count = 0
        self.norms: dict[int, float] = {}
        self.landed: set[int] = set()  # units whose accumulator holds this step's gradient
        self.scratch: Tensor | None = None

    def new_step(self) -> None:
        """The next landing of every unit starts its accumulator afresh."""
        self.landed.clear()

    def land(
        self,
        index: int,
        unit: Unit,
        grad: Tensor,
        dtype: torch.dtype,
        norm: bool = False,
        then: Callable[[], None] | None = None,
        final: bool = False,
    ) -> Future[None] | None:
        """Evacuate ``grad`` (device) into ``unit``'s accumulator. ``norm`` (the unit's last
        landing of a clipped step) also takes the unit's squared norm; ``then`` (its last
        landing of an unclipped step: the update) runs on the host thread right after, once
        the slab is free again, and its future is returned. ``final`` (the unit's last landing
        of the step) then runs ``reduce`` on the accumulator, before the norm of the unit's
        piece (``lo:hi``, data parallel; otherwise all of it) is taken."""
        if len(self.landings) >= len(self.slabs):
            self.landings.pop(0).result()  # frees the oldest slab (and its device gradient)
        slab = self.slabs[self.count % len(self.slabs)][: unit.numel]
        self.count += 1
        first = index not in self.landed
        self.landed.add(index)
        # the device gradient, held until the copy that reads it has completed and released
        # before the landing's future completes (the executor keeps a finished task's
        # arguments a moment longer, past the point a waiter resumes)
        source = [grad.detach().reshape(-1).to(dtype)]
        event = self.backend.d2h(slab, source[0])

        def work() -> None:
            # host work: a DeviceCap (a dispatch mode) is thread-local and never sees it
            self.backend.synchronize(event)
            source.clear()
            padded = unit.host["grad"]  # data parallel: world equal pieces, zero past numel
            acc = padded[: unit.numel]
            if first:
                acc.copy_(slab)
            elif slab.dtype == acc.dtype:
                acc.add_(slab)
            else:
                self._add_converted(acc, slab)
            if final and self.reduce is not None:
                self.reduce(padded)
            if norm:
                self.norms[index] = grad_norm_sq([acc if unit.hi < 0 else acc[unit.lo : unit.hi]])

        self.landings.append(self.executor.submit(work))
        return None if then is None else self.executor.submit(then)

    def _add_converted(self, acc: Tensor, slab: Tensor) -> None:
        """``acc += slab`` for a 16-bit slab, through an fp32 scratch of ``CHUNK`` elements
        made on the host thread (a mixed-dtype add, or a whole fp32 copy of the slab, runs
        several times slower)."""
        if self.scratch is None:
            self.scratch = torch.empty(CHUNK, dtype=torch.float32)
        for start in range(0, acc.numel(), CHUNK):
            end = min(acc.numel(), start + CHUNK)
            part = self.scratch[: end - start].copy_(slab[start:end])
            acc[start:end].add_(part)

    def drain(self) -> None:
        """Wait for every landing (and surface any error from the host thread)."""
        while self.landings:
            self.landings.pop(0).result()

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self.executor.submit(fn)

    def __enter__(self) -> HostWork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def _units(model: DecoderLM) -> list[Unit]:
    groups: list[tuple[str, list[tuple[str, Tensor]]]] = [
        ("embed_tokens", [("weight", model.embed_tokens.weight)])
    ]
    for i, layer in enumerate(model.layers):
        groups.append((f"layers.{i}", list(layer.named_parameters())))
    head: list[tuple[str, Tensor]] = [(f"norm.{n}", p) for n, p in model.norm.named_parameters()]
    if model.lm_head is not None:
        head += [(f"lm_head.{n}", p) for n, p in model.lm_head.named_parameters()]
    groups.append(("head", head))
    units = []
    for name, params in groups:
        offsets, offset = [], 0
        for _, p in params:
            offsets.append(offset)
            offset += p.numel()
        units.append(
            Unit(name, [n for n, _ in params], [p.shape for _, p in params], offsets, offset)
        )
    return units


def _full_name(unit: Unit, name: str) -> str:
    if unit.name == "embed_tokens":
        return "embed_tokens.weight"
    if unit.name == "head":
        return name
    return f"{unit.name}.{name}"


def _host_fields(
    u: Unit, train: TrainSpec, dtype: torch.dtype, ranks: Ranks
) -> list[tuple[str, int, torch.dtype]]:
    """A unit's host fields on one rank: the whole working copy (padded to ``world`` equal
    pieces, which the all-gather fills) and gradient accumulator, and the rank's piece of the
    fp32 master, moments and EMA."""
    states = DTYPES[train.precision.optimizer_states]
    lo, hi = ranks.shard(u.numel)
    piece = hi - lo
    fields = [("working", ranks.piece(u.numel) * ranks.world, dtype)]
    fields += [("master", piece, torch.float32), ("m", piece, states), ("v", piece, states)]
    # the accumulator padded to ``world`` equal pieces too: the reduce-scatter's input
    fields.append(("grad", ranks.piece(u.numel) * ranks.world, torch.float32))
    if train.ema != "none":
        fields.append(("ema", piece, torch.float32))
    return fields


def _pack(
    init: DecoderLM, train: TrainSpec, backend: CpuBackend, dtype: torch.dtype, ranks: Ranks
) -> list[Unit]:
    """The host side of streaming: each unit's whole state in one contiguous (pinned) buffer,
    carved into the working copy, fp32 master, moments, gradient accumulator and EMA (data
    parallel: the rank's piece of the master, moments and EMA)."""
    params = dict(init.named_parameters())
    units = _units(init)
    for u in units:
        master = torch.cat([params[_full_name(u, n)].detach().reshape(-1) for n in u.names])
        fields = _host_fields(u, train, dtype, ranks)
        u.lo, u.hi = ranks.shard(u.numel)
        u.host = carve(backend.host_buffer(carved_bytes(fields)), fields)
        u.host["working"][: u.numel].copy_(master)
        u.host["master"].copy_(master[u.lo : u.hi])
        if "ema" in u.host:
            u.host["ema"].copy_(master[u.lo : u.hi])
    return units


def _train_streaming(
    spec: ModelSpec,
    train: TrainSpec,
    cfg: RunConfig,
    on_phase: PhaseHook,
    backend: CpuBackend,
    on_step: StepHook,
) -> Result:
    device = torch.device(cfg.device)
    dtype = cfg.dtype
    precision = runtime_precision(train, working(cfg))
    # initial weights: built on the host in fp32, then packed per unit
    with host():
        init = build_model(spec, seed=cfg.seed, dtype=torch.float32, device="cpu")
        units = _pack(init, train, backend, dtype, cfg.ranks)

    # compute templates: module structure without storage; weights come from the pool
    with torch.device("meta"), SkipInit():
        templates = [
            DecoderLayer(spec, spec.is_moe_layer(i), init.capacity_factor)
            for i in range(spec.num_layers)
        ]
        head_norm = type(init.norm)(spec.hidden_size, spec)
    del init
    largest = max(u.numel for u in units)
    pool = Pool(train.offload.num_buffers, largest, dtype, device)
    stream = Streamer(units, pool, backend)
    with host():  # two pinned gradient slabs, shared by every unit
        slab_fields = [(f"slab{i}", largest, dtype) for i in range(2)]
        slabs = list(carve(backend.host_buffer(carved_bytes(slab_fields)), slab_fields).values())
    ranks = cfg.ranks
    reduce = ranks.reduce_scatter_host_ if ranks.distributed else None
    with HostWork(backend, slabs, reduce) as work:
        n_layers = spec.num_layers
        k = train.checkpoint_every or 1
        o = cfg.optim
        losses: list[float] = []
        last_micro = train.grad_accum_steps - 1

        clip = train.max_grad_norm

        def land(index: int, grad: Tensor, final: bool, step: int) -> None:
            """Land a unit's gradient; its last landing of the step takes its norm (clipping)
            or starts its update at once (no clipping: the update overlaps the backward, and
            the unit's next load waits for it)."""
            if final and clip is None:
                update = partial(_update_shard, o, step, units[index], 1.0, ranks)
                ready = work.land(index, units[index], grad, dtype, then=update, final=True)
                assert ready is not None
                stream.host_ready[index] = ready
            else:
                work.land(index, units[index], grad, dtype, norm=final, final=final)

        def layer_forward(i: int, flat: Tensor, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            out: Tensor = functional_call(templates[i], units[1 + i].views(flat), (h, cos, sin))
            return out

        tied = spec.tied_embeddings

        def micro_batch(step: int, micro: int) -> float:
            """One micro-batch's forward and backward; its tensors die on return."""
            ids, labels = micro_batch_tokens(spec, train, cfg, step, micro)
            ids, labels = ids.to(device), labels.to(device)
            cos, sin = rope_tables(train.seq_len, rope_dim(spec), dtype, device)
            # forward: embedding, layers without autograd, checkpoints every k layers
            # compute is issued before the next prefetch: that one may wait for the CPU
            # optimizer to finish the next unit, and the device should be busy meanwhile
            slot, flat = stream.acquire(0)
            with torch.no_grad():
                h = F.embedding(ids, units[0].views(flat)["weight"])
            if n_layers and cfg.prefetch:
                stream.prefetch(1)
            stream.release(slot)
            checkpoints: dict[int, Tensor] = {}
            for i in range(n_layers):
                if i % k == 0:
                    checkpoints[i] = h
                slot, flat = stream.acquire(1 + i)
                with torch.no_grad():
                    h = layer_forward(i, flat, h, cos, sin)
                if cfg.prefetch:
                    stream.prefetch(2 + i if i + 1 < n_layers else len(units) - 1)
                stream.release(slot)
            # head and loss (and the tied embedding), with autograd on the pool buffers
            # themselves (held until the loss's backward is done), as each layer's backward
            # runs: no copy of the head's weights
            head = len(units) - 1
            head_slot, flat = stream.acquire(head)
            head_w = flat.detach().requires_grad_(True)
            embed_slot, embed_w = None, None
            if tied:
                embed_slot, flat = stream.acquire(0)
                embed_w = flat.detach().requires_grad_(True)
            x = h.detach().requires_grad_(True)
            views = units[head].views(head_w)
            normed = functional_call(
                head_norm,
                {n.split(".", 1)[1]: t for n, t in views.items() if n.startswith("norm.")},
                (x,),
            )
            if embed_w is not None:
                weight = embed_w.view(spec.vocab_size, spec.hidden_size)
            else:
                weight = views["lm_head.weight"]
            bias = views.get("lm_head.bias")
            loss = loss_fn(F.linear(normed, weight, bias), labels)
            on_phase("forward", step)
            (loss / train.grad_accum_steps).backward()
            stream.release(head_slot)
            if embed_slot is not None:
                stream.release(embed_slot)
            loss_value = loss.item()
            assert head_w.grad is not None and x.grad is not None
            last = micro == last_micro
            land(head, head_w.grad, last, step)
            if embed_w is not None:  # the embedding's own backward lands after this
                assert embed_w.grad is not None
                land(0, embed_w.grad, False, step)
            grad_h = x.grad
            # the head's autograd graph goes before the layers' backward: it holds the pool
            # and the draining gradients only
            del head_w, embed_w, weight, bias, views, normed, x, loss
            # backward: each block recomputed from its checkpoint, layer by layer
            for b in reversed(range(0, n_layers, k)):
                e = min(b + k, n_layers)
                inputs = [checkpoints.pop(b)]
                for i in range(b, e - 1):
                    slot, flat = stream.acquire(1 + i)
                    with torch.no_grad():
                        inputs.append(layer_forward(i, flat, inputs[-1], cos, sin))
                    stream.release(slot)
                for i in reversed(range(b, e)):
                    slot, flat = stream.acquire(1 + i)
                    nxt = i - 1 if i > b else (b - 1 if b > 0 else None)
                    if nxt is not None and cfg.prefetch:
                        stream.prefetch(1 + nxt if i > b else 1 + max(b - k, 0))
                    w = flat.detach().requires_grad_(True)
                    xi = inputs[i - b].detach().requires_grad_(True)
                    out = layer_forward(i, w, xi, cos, sin)
                    torch.autograd.backward(out, grad_h)
                    stream.release(slot)
                    assert w.grad is not None and xi.grad is not None
                    land(1 + i, w.grad, last, step)
                    grad_h = xi.grad
            # embedding backward: scatter the input gradient into the rows that were used
            embed_grad = torch.zeros(
                spec.vocab_size, spec.hidden_size, dtype=grad_h.dtype, device=device
            )
            embed_grad.index_add_(0, ids.reshape(-1), grad_h.reshape(-1, spec.hidden_size))
            land(0, embed_grad, last, step)
            on_phase("backward", step)
            return loss_value

        start = time.perf_counter()
        on_phase("placement", 0)
        for step in range(1, cfg.steps + 1):
            total = 0.0
            for micro in range(train.grad_accum_steps):
                total += micro_batch(step, micro)
            # resident copies are about to go stale: the next step loads every unit afresh,
            # each load waiting for that unit's update only
            stream.invalidate()
            work.new_step()
            if clip is not None:
                # the CPU optimizer, on the host thread, unit by unit in the order the next
                # forward loads them, with the clipping coefficient of the whole step
                work.drain()
                # the squares of every rank's pieces (one process: of the whole units)
                norm_sq = ranks.sum_float(sum(work.norms.pop(i) for i in range(len(units))), device)
                coef = clip_coefficient(norm_sq, clip)
                for index, u in enumerate(units):
                    update = partial(_update_shard, o, step, u, coef, ranks)
                    stream.host_ready[index] = work.submit(update)
            on_phase("optimizer", step)
            losses.append(ranks.mean_float(total, device) / train.grad_accum_steps)
            on_step(step, losses[-1])
        for ready in stream.host_ready.values():
            ready.result()
        stream.host_ready.clear()
        work.drain()
        seconds = time.perf_counter() - start
        state: dict[str, Tensor] = {}
        ema: dict[str, Tensor] | None = {} if train.ema != "none" else None
        with host():
            for u in units:
                for n, t in u.views(_gathered(ranks, u.host["master"], u.numel)).items():
                    state[_full_name(u, n)] = t.clone()
                if ema is not None:
                    for n, t in u.views(_gathered(ranks, u.host["ema"], u.numel)).items():
                        ema[_full_name(u, n)] = t.clone()
        return Result(
            losses,
            cfg.steps,
            _tokens(train, cfg),
            seconds,
            {
                "mode": "streaming",
                "precision": precision.model_dump(),
                "ema": train.ema,
                "max_grad_norm": clip,
                # when the CPU AdamW updates a unit: once the step's norm is known (clipping),
                # or as the unit's last gradient lands, during the backward
                "cpu_update": "after_norm" if clip is not None else "as_gradients_land",
                "checkpoint_every": k,
                "num_buffers": train.offload.num_buffers,
                "device_buffer_bytes": pool.buffers[0].numel() * pool.buffers[0].element_size(),
                "peak_buffers_in_use": pool.peak_in_use,
                "host_to_device_loads": pool.loads,
                "data_parallel": ranks.world,
                "host_state_bytes": backend.host_bytes,
                "host_pinning": backend.pinning,
            },
            state,
            ema,
        )


def _update_unit(o: AdamWConfig, step: int, u: Unit, coef: float) -> None:
    """One unit's CPU AdamW (on the host thread) on the rank's piece of it; the spent
    accumulator is overwritten by the unit's first landing of the next step."""
    lo, hi = u.lo, (u.numel if u.hi < 0 else u.hi)
    adamw_step(
        o,
        step,
        u.host["master"],
        u.host["grad"][lo:hi],
        u.host["m"],
        u.host["v"],
        grad_scale=coef,
        ema=u.host.get("ema"),
        working=u.host["working"][lo:hi],
    )


def _update_shard(o: AdamWConfig, step: int, u: Unit, coef: float, ranks: Ranks) -> None:
    """``_update_unit``, then (data parallel) every rank's updated piece of the working copy
    gathered into the whole one the next forward streams."""
    _update_unit(o, step, u, coef)
    if ranks.distributed:
        size = ranks.piece(u.numel)
        working = u.host["working"]
        mine = working[ranks.rank * size : (ranks.rank + 1) * size].clone()
        torch.distributed.all_gather_single(working, mine, group=ranks.host_group)


def train_model(
    spec: ModelSpec,
    train: TrainSpec,
    cfg: RunConfig,
    on_phase: PhaseHook = _noop,
    backend: CpuBackend | None = None,
    on_step: StepHook | None = None,
) -> Result:
    """Train ``spec`` under ``train``'s placement (or the reference) and report; ``on_step``
    hears each step's loss as it ends."""
    on_step = on_step or _no_step
    if cfg.reference or (train.offload.mode == "none" and torch_adamw_keeps(train, cfg)):
        return _train_reference(spec, train, cfg, on_phase, on_step)
    backend = backend or make_backend(torch.device(cfg.device))
    try:
        if train.offload.mode in ("none", "optimizer"):
            result = _train_optimizer_offload(spec, train, cfg, on_phase, backend, on_step)
        else:
            result = _train_streaming(spec, train, cfg, on_phase, backend, on_step)
    finally:
        backend.release_host()  # unlock what the run pinned, also after an out-of-memory
    ranks = cfg.ranks
    if ranks.distributed:
        # what every rank pinned, in rank order, and how many ranks share a node's RAM
        result.placement["host_state_bytes_per_rank"] = ranks.gather_ints(backend.host_bytes)
        result.placement["local_world_size"] = ranks.local_world
    return result
