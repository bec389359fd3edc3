#!/usr/bin/env python3
"""What ``headroom.hooks.MemoryReporter`` adds to a training step.

Trains the bundled trainer's model (``--model``, default tiny-dense) for ``--steps`` steps on
the CPU under its simulated device, once with no hook and once with a reporter that reads the
device's peaks at every phase and writes its record after step 2 (to a file: no service), and
prints each run's seconds a step, the time spent inside the hook and that time as a share of the
two steps it reads (1 and 2: it sends its record after step 2 and is idle after). The hook's
share is what it adds; the two runs' difference also holds the machine's noise. On a GPU the
hook reads ``torch.cuda.memory_stats()`` and resets the peaks at each phase, microseconds
against steps of tens of milliseconds or more.

    .venv/bin/python bench/hook_overhead.py --steps 20
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from headroom import planner
from headroom.hooks import MemoryReporter
from headroom.runtime.cap import DeviceCap
from headroom.runtime.trainer import RunConfig, train_model


def _run(model: str, steps: int, seq: int, hook: MemoryReporter | None) -> float:
    spec = planner.load_model(model)
    train = planner.TrainSpec(micro_batch_size=2, seq_len=seq, activation_profile="runtime")
    start = time.perf_counter()
    with DeviceCap(1 << 36):
        if hook is None:
            train_model(spec, train, RunConfig(steps=steps, dtype=torch.bfloat16))
        else:
            train_model(spec, train, RunConfig(steps=steps, dtype=torch.bfloat16), hook)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    spec = {"model": args.model, "train": {"micro_batch_size": 2, "seq_len": args.seq}}
    _run(args.model, 2, args.seq, None)  # warm up: imports, first allocations
    bare = _run(args.model, args.steps, args.seq, None)
    with tempfile.TemporaryDirectory() as out:
        reporter = MemoryReporter(Path(out) / "record.json", "bench", spec, report_after_step=2)
        hooked = _run(args.model, args.steps, args.seq, reporter)
        assert reporter.sent is not None, "the reporter sent nothing"
    print(f"{args.model}, {args.steps} steps of 2 x {args.seq} tokens, CPU, simulated device")
    print(f"  no hook     {bare / args.steps * 1e3:9.2f} ms a step")
    print(f"  hooked      {hooked / args.steps * 1e3:9.2f} ms a step")
    reads = len(reporter.phases)
    step = hooked / args.steps
    # the reporter reads each phase of steps 1 and 2, sends once, and is idle after
    print(
        f"  in the hook {reporter.seconds * 1e6:9.1f} us in all: {reads} phase reads and one "
        f"record written, {reporter.seconds / (2 * step):.4%} of the two steps it reads"
    )


if __name__ == "__main__":
    main()
