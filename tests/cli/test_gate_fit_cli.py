"""``headroom gate`` exit codes and formats, and ``headroom fit``, through a real subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from xml.etree import ElementTree as ET

from headroom_process import run_headroom

from headroom import planner
from headroom.cli.render import changes_text, offload_text, recompute_text

WIDE = {**os.environ, "COLUMNS": "400"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_headroom(*args, timeout=120)


def test_gate_fits_exits_0_with_the_verdict() -> None:
    proc = run("gate", "tiny-dense", "--gpu", "H100-80GB", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout)
    budget = planner.estimate(
        planner.load_model("tiny-dense"), planner.TrainSpec(), planner.gpu("H100-80GB")
    )
    assert verdict["decision"] == "fits" and verdict["gpu_peak_bytes"] == budget.gpu_peak_bytes


def test_gate_predicted_oom_exits_1_with_github_annotation() -> None:
    proc = run("gate", "llama-3-70b", "--gpu", "RTX-4090", "--format", "github")
    assert proc.returncode == 1
    assert proc.stdout.startswith("::error title=Headroom gate::oom: llama-3-70b on RTX-4090")


def test_gate_margin_can_turn_fits_into_oom() -> None:
    budget = planner.estimate(
        planner.load_model("llama-3-8b"), planner.TrainSpec(), planner.gpu("H200-141GB")
    )
    # 147.6 GB of the card's 150.8 GB: it fits with no margin, not with the default 6 %
    assert not budget.fits and budget.gpu_peak_bytes <= budget.gpu.capacity_bytes
    assert budget.margin_bytes == -(-budget.gpu_peak_bytes * 6 // 100)
    proc = run("gate", "llama-3-8b", "--gpu", "H200-141GB", "--margin", "0", "--format", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["margin_bytes"] == 0
    proc = run("gate", "llama-3-8b", "--gpu", "H200-141GB", "--margin", "10", "--format", "json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["margin_bytes"] == -(-budget.gpu_peak_bytes * 10 // 100)


def test_gate_malformed_input_exits_2_with_one_line() -> None:
    proc = run("gate", "tiny-dense", "--set", "recompute=sometimes")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "recompute" in lines[0] and "Traceback" not in proc.stderr
    assert run("gate", "no-such-model").returncode == 2


def test_gate_without_calibration_exits_3_when_required(tmp_path: Path) -> None:
    report = tmp_path / "gate.xml"
    proc = run(
        "gate", "tiny-dense", "--require-calibration", "--format", "junit", "--output", str(report)
    )
    assert proc.returncode == 3
    suite = ET.parse(report).getroot()
    assert suite.tag == "testsuite" and suite.get("errors") == "1"
    assert suite.find("testcase/error") is not None


def test_gate_junit_reports_a_failure_for_oom(tmp_path: Path) -> None:
    proc = run("gate", "llama-3-70b", "--gpu", "RTX-4090", "--format", "junit")
    assert proc.returncode == 1
    suite = ET.fromstring(proc.stdout.split("?>", 1)[1])
    failure = suite.find("testcase/failure")
    assert suite.get("failures") == "1" and failure is not None
    assert "exceeds capacity" in (failure.get("message") or "")


def test_fit_prints_a_plan_that_fits() -> None:
    proc = run(
        "fit", "llama-3-8b", "--gpu", "H100-80GB", "--set", "micro_batch_size=8", "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("plan", "budget", "predicted_step_seconds", "candidates_considered", "rejected"):
        assert key in result
    plan = planner.TrainSpec.model_validate(result["plan"])
    assert planner.estimate(planner.load_model("llama-3-8b"), plan, planner.gpu("H100-80GB")).fits


def test_fit_exits_1_when_nothing_fits() -> None:
    proc = run("fit", "deepseek-v3", "--gpu", "RTX-3090", "--host-memory", "64GiB")
    assert proc.returncode == 1
    assert "no candidate fits" in proc.stdout


def test_gate_invalid_input_still_writes_the_ci_report(tmp_path: Path) -> None:
    """A CI page shows a report, not stderr: on input the gate cannot judge (exit 2) the JUnit
    report has an error case and the GitHub format an ::error annotation, each with the reason;
    stderr keeps its one error line."""
    report = tmp_path / "gate.xml"
    args = ("gate", "llama-3-8b", "--set", "micro_batch=2")
    proc = run(*args, "--format", "junit", "--output", str(report))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: train.micro_batch: unknown field")
    suite = ET.parse(report).getroot()
    assert suite.get("errors") == "1" and suite.get("failures") == "0"
    (error,) = suite.iter("error")
    assert error.get("type") == "InvalidInput" and "micro_batch_size" in error.get("message", "")
    github = run(*args, "--format", "github")
    assert github.returncode == 2
    assert github.stdout.startswith("::error title=Headroom gate::invalid input: train.micro_batch")
    as_json = json.loads(run(*args, "--format", "json").stdout)
    assert as_json["decision"] == "invalid_input" and as_json["exit_code"] == 2


def test_every_size_the_gate_and_the_plan_print_is_in_binary_units() -> None:
    """A reason read by a person names GiB (or MiB, TiB), never raw bytes: the gate's verdict
    in each format, and the plan's rejections. The JSON keeps the exact bytes in its fields."""
    raw = re.compile(r"\b\d{4,} B\b")
    for fmt in ("text", "github", "json"):
        proc = run("gate", "llama-3-70b", "--gpu", "RTX-4090", "--format", fmt)
        assert proc.returncode == 1 and not raw.search(proc.stdout), proc.stdout
    verdict = json.loads(run("gate", "llama-3-70b", "--gpu", "RTX-4090", "--format", "json").stdout)
    assert "GiB" in verdict["reason"] and verdict["gpu_peak_bytes"] > 2**30
    args = ("--gpus", "64", "--gpu", "H100-80GB", "--global-batch", "512", "--seq", "8192")
    plan = run("plan", "llama-3-70b", *args)
    assert plan.returncode == 0 and "rejected tp" in plan.stdout
    assert not raw.search(plan.stdout), plan.stdout
    assert re.search(
        r"GPU peak [\d.]+ TiB \+ margin [\d.]+ GiB\s+> capacity 79.65 GiB", plan.stdout
    )


def test_the_fit_text_reads_as_words_not_python_reprs() -> None:
    """The chosen recompute and offload, and each probe's changes, read as a person writes
    them: no dict repr, no "changes {}"."""
    proc = run_headroom("fit", "llama-3-8b", "--gpu", "H100-80GB", env=WIDE)
    assert proc.returncode == 0, proc.stderr
    assert "{" not in proc.stdout and "}" not in proc.stdout, proc.stdout
    assert "offload=optimizer (0.625 of its state in host RAM)" in proc.stdout


def test_changes_and_placements_render_as_words() -> None:
    assert changes_text({}) == "none"
    assert (
        changes_text(
            {"micro_batch_size": 2, "recompute": {"every_k": 8}, "offload": {"mode": "none"}}
        )
        == "micro_batch_size=2, recompute=every 8 layers, offload=none"
    )
    assert offload_text({"mode": "streaming", "checkpoint_every": 4, "num_buffers": 2}) == (
        "streaming (checkpoint every 4, 2 buffers)"
    )
    assert recompute_text("selective_op") == "selective_op" and offload_text("none") == "none"
