"""``headroom train``: the report contract, placements through the CLI, and clean refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from headroom_process import run_headroom

from headroom.planner.report import TrainerReport


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_headroom("train", *args, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_report_contract_and_parity_through_the_cli(tmp_path: Path) -> None:
    shape = ["tiny-moe", "--steps", "3", "--set", "seq_len=16", "--set", "micro_batch_size=2"]
    common = [*shape, "--dtype", "float32"]
    ref = run(*common, "--reference", "--report", str(tmp_path / "ref.json"))
    assert ref.returncode == 0, ref.stderr
    report = json.loads((tmp_path / "ref.json").read_text())
    assert report == json.loads(ref.stdout)
    assert TrainerReport.model_validate(report).dump() == report  # one typed model, same keys
    assert len(report["losses"]) == report["steps"] == 3
    assert report["tokens_per_second"] > 0
    assert report["placement"]["mode"] == "none"
    assert report["attention_kv"] == "repeated"  # tiny-moe is GQA; fp32 repeats
    assert report["memory"]["available"] is False and "CUDA" in report["memory"]["reason"]

    streamed = run(
        *common, "--set", "offload.mode=streaming", "--set", "offload.checkpoint_every=2"
    )
    assert streamed.returncode == 0, streamed.stderr
    s = json.loads(streamed.stdout)
    assert s["placement"]["mode"] == "streaming" and s["placement"]["checkpoint_every"] == 2
    assert s["losses"] == pytest.approx(report["losses"], rel=1e-5)

    # no --dtype: the spec's precision, as launch trains it (16-bit params: bfloat16), and the
    # report's train.precision is what was kept, as its dtype
    half = run(*shape)
    assert half.returncode == 0, half.stderr
    h = json.loads(half.stdout)
    assert h["attention_kv"] == "grouped" and h["dtype"] == "bfloat16"
    assert h["train"]["precision"]["params"] == "bf16"
    assert report["dtype"] == "float32" and report["train"]["precision"]["params"] == "fp32"


def test_models_the_trainer_cannot_build_are_refused_with_one_line() -> None:
    proc = run("gpt3-175b", "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "model.dropout" in proc.stderr
    # one it can build but this machine cannot hold: refused before anything is allocated
    proc = run("deepseek-v3", "--steps", "1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "model: deepseek-v3 has" in proc.stderr


def test_cuda_runs_with_the_memory_probe_or_is_refused_without_cuda() -> None:
    import torch

    proc = run("tiny-dense", "--steps", "2", "--device", "cuda", "--set", "seq_len=16")
    if not torch.cuda.is_available():
        assert proc.returncode == 2 and "cuda is not available" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["memory"]
    assert memory["available"] is True and memory["allocated_peak_bytes"] > 0
    phases = [(s["phase"], s["step"]) for s in memory["phases"]]
    assert ("optimizer", 1) in phases and ("optimizer", 2) in phases


def test_bad_training_key_exits_2() -> None:
    proc = run("tiny-dense", "--set", "offload.mode=sideways")
    assert proc.returncode == 2 and "offload.mode" in proc.stderr
