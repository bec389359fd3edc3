"""``headroom fit`` with specs at the training spec's bounds: one answer, never a traceback."""

from __future__ import annotations

import json

from headroom_process import run_headroom

from headroom import planner


def test_fit_with_the_largest_accumulation_prints_a_valid_plan() -> None:
    proc = run_headroom(
        "fit",
        "llama-3-8b",
        "--gpu",
        "H100-80GB",
        "--set",
        "grad_accum_steps=1073741824",
        "--set",
        "micro_batch_size=2",
        "--format",
        "json",
        timeout=120,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    plan = planner.TrainSpec.model_validate(json.loads(proc.stdout)["plan"])
    assert plan.micro_batch_size * plan.grad_accum_steps == 2**31
