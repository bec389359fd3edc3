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


def test_gpus_per_node_is_capped_like_the_service() -> None:
    from headroom.planner.hardware import MAX_GPUS_PER_NODE

    proc = run_headroom(
        "estimate", "tiny-dense", "--gpus-per-node", str(10**20), "--format", "json", timeout=60
    )
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr and "--gpus-per-node" in proc.stderr
    assert str(MAX_GPUS_PER_NODE) in proc.stderr


def test_impossible_layout_exits_2_naming_the_field() -> None:
    for option in ("parallel.tp=3", "parallel.pp=64", "micro_batch_size=true"):
        proc = run_headroom("estimate", "llama-3-8b", "--set", option, timeout=60)
        assert proc.returncode == 2, (option, proc.stdout)
        assert "Traceback" not in proc.stderr
        assert f"train.{option.partition('=')[0]}" in proc.stderr, proc.stderr
