"""``headroom train``: the bundled trainer on synthetic tokens, with its memory probe's report.

This is the process every launch and probe starts (``headroom train ... --report FILE``); its
exit code ``ExitCode.OUT_OF_MEMORY`` tells the launcher the device ran out of memory. torch is
imported inside the command.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from headroom import planner
from headroom.cli.exits import ExitCode, fail, is_out_of_memory, user_errors, writable, writing
from headroom.cli.options import ModelArg, SetOpt, TrainOpt, train_dict
from headroom.planner.units import parse_size

#: the largest ``--seed`` (the usual 32-bit range)
MAX_SEED = 2**32 - 1


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class StepLog:
    """``--progress``: one JSON line per optimizer step, appended and flushed as the step
    ends, so that a launcher (or ``tail -f``) follows the run. ``seconds`` counts from the
    trainer's start (building the model and its state included); ``tokens_per_s`` is over the
    steps after the first, whose time holds that build and the first pass's warm-up (None
    for the first)."""

    def __init__(self, path: Path, steps: int, tokens_per_step: int) -> None:
        import time

        self.path, self.steps, self.tokens_per_step = path, steps, tokens_per_step
        self.clock = time.monotonic
        self.start = self.clock()
        self.first: float | None = None  # when the first step ended
        path.write_text("")  # this run's lines only, not an earlier run's

    def __call__(self, step: int, loss: float) -> None:
        now = self.clock()
        rate = None
        if self.first is None:
            self.first = now
        elif now > self.first:
            rate = round((step - 1) * self.tokens_per_step / (now - self.first), 1)
        line = {
            "step": step,
            "steps": self.steps,
            "loss": loss,
            "seconds": round(now - self.start, 4),
            "tokens": step * self.tokens_per_step,
            "tokens_per_s": rate,
        }
        with writing("--progress", self.path), self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")


def train_command(
    model: ModelArg,
    train: TrainOpt = None,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 10,
    device: Annotated[Device, typer.Option("--device", help="Where to compute.")] = Device.cpu,
    dtype: Annotated[
        DType | None,
        typer.Option(
            "--dtype",
            help="Working precision (default: the spec's, as launch trains it: bfloat16 for "
            "16-bit precision.params, float32 for fp32).",
        ),
    ] = None,
    seed: Annotated[
        int,
        # the trainer seeds torch with seed * 1_000_003 + step * 1009 + micro, which torch
        # takes up to 2^64 - 1: a 32-bit seed leaves that room for any step count
        typer.Option("--seed", min=0, max=MAX_SEED, help="Weights and data seed."),
    ] = 0,
    reference: Annotated[
        bool, typer.Option("--reference", help="Plain PyTorch AdamW, whatever the placement.")
    ] = False,
    report: Annotated[
        Path | None, typer.Option("--report", help="Write the JSON report here.", dir_okay=False)
    ] = None,
    save_weights: Annotated[
        Path | None,
        typer.Option(
            "--save-weights",
            help="Save the final fp32 master weights and EMA here (torch.save; rank 0 of a "
            "data-parallel run).",
            dir_okay=False,
        ),
    ] = None,
    progress: Annotated[
        Path | None,
        typer.Option(
            "--progress",
            help="Append one JSON line per optimizer step here as the run goes (rank 0 of a "
            "data-parallel run): step, steps, loss, seconds, tokens, tokens_per_s.",
            dir_okay=False,
        ),
    ] = None,
    memory_cap: Annotated[
        str | None,
        typer.Option(
            "--memory-cap",
            help="Device memory to allow, e.g. 48MiB: on CUDA the allocator's per-process "
            "fraction; on a CPU a simulated device that runs out of memory past it.",
        ),
    ] = None,
) -> None:
    """Train with the bundled trainer on synthetic tokens; exit 3 on out-of-memory."""
    if report is not None:
        writable("--report", report)  # now, not after the training it would report
    if save_weights is not None:
        writable("--save-weights", save_weights)
    if progress is not None:
        writable("--progress", progress)
    with user_errors():
        spec = planner.load_model(model)
        train_spec = planner.load_train(train_dict(train, set_ or []))
        from headroom.runtime.dist import torchrun_world

        world = torchrun_world()
        if world is not None and world != train_spec.parallel.dp:
            raise fail(
                f"parallel.dp: the spec trains {train_spec.parallel.dp} data-parallel ranks, "
                f"torchrun started {world}; they must be equal"
            )
        cap_bytes = None if memory_cap is None else parse_size(memory_cap, field="--memory-cap")
        from headroom.planner.trainable import TORCH_DTYPE, working_precision
        from headroom.runtime.support import (
            WORKING,
            check_memory_holds,
            check_supported,
            runtime_precision,
        )

        check_supported(spec)
        working = WORKING[dtype.value] if dtype is not None else working_precision(train_spec)
        # the report's train.precision is what the trainer keeps, as its dtype is
        train_spec = train_spec.model_copy(
            update={"precision": runtime_precision(train_spec, working)}
        )
        dtype_name = TORCH_DTYPE[working]
    import contextlib

    import torch

    from headroom.planner.report import OutOfMemoryAt, TrainerReport
    from headroom.runtime.cap import DeviceCap
    from headroom.runtime.dist import close_ranks, init_ranks
    from headroom.runtime.model import kv_layout
    from headroom.runtime.probe import MemoryProbe
    from headroom.runtime.trainer import RunConfig, tokens_per_step, train_model

    if device is Device.cuda and not torch.cuda.is_available():
        raise fail("--device: cuda is not available on this machine; allowed here: cpu")
    torch_device = torch.device(device.value)
    total = (
        torch.cuda.get_device_properties(torch_device).total_memory if device is Device.cuda else 0
    )
    with user_errors():
        check_memory_holds(spec, total)
    cap: DeviceCap | None = None
    if cap_bytes is not None and device is Device.cuda:
        if cap_bytes > total:
            raise fail(f"--memory-cap: {cap_bytes} bytes is more than the device's {total}")
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, torch_device)
    elif cap_bytes is not None:
        cap = DeviceCap(cap_bytes)
    ranks = init_ranks(torch_device)
    if device is Device.cuda and ranks.distributed:
        torch_device = torch.device("cuda", ranks.local_rank)
    probe = MemoryProbe(torch_device, cap)
    cfg = RunConfig(
        steps=steps,
        device=str(torch_device),
        dtype=getattr(torch, dtype_name),
        seed=seed,
        reference=reference,
        ranks=ranks,
    )
    out = TrainerReport(
        model=spec.name, train=train_spec, device=device.value, dtype=dtype_name, seed=seed
    )
    code = ExitCode.OK
    if cap_bytes is not None:
        out.memory_cap_bytes = cap_bytes
    try:
        with cap if cap is not None else contextlib.nullcontext():
            on_step = (
                StepLog(progress, steps, tokens_per_step(train_spec, ranks.world))
                if progress is not None and ranks.rank == 0
                else None
            )
            result = train_model(spec, train_spec, cfg, on_phase=probe, on_step=on_step)
        out.losses = result.losses
        out.steps = result.steps
        out.tokens_per_second = result.tokens_per_second
        out.placement = result.placement
        out.attention_kv = kv_layout(spec, torch_device, cfg.dtype)
        if save_weights is not None and ranks.rank == 0:
            with writing("--save-weights", save_weights):
                torch.save({"state": result.state, "ema": result.ema}, save_weights)
    except (RuntimeError, MemoryError) as exc:
        # the device's torch.OutOfMemoryError, or a host allocation torch could not make (a
        # RuntimeError from its CPU allocator: on a CPU run the batch lives on the host)
        if not is_out_of_memory(exc):
            raise
        code = ExitCode.OUT_OF_MEMORY
        out.oom = OutOfMemoryAt(**probe.failing_phase(), message=str(exc).splitlines()[0])
    out.memory = probe.report()
    close_ranks(ranks)
    if ranks.rank != 0:  # rank 0 reports a data-parallel run
        raise typer.Exit(code)
    text = json.dumps(out.dump(), indent=2)
    if report is not None:
        with writing("--report", report):
            report.write_text(text + "\n")
    typer.echo(text)
    if out.oom is not None:
        typer.echo(f"error: out of memory in {out.oom.phase}, step {out.oom.step}", err=True)
    raise typer.Exit(code)
