"""The documented GitHub Actions gate runs as written: its ``headroom`` steps are executed
(without a shell) from the repository root, and the gate fails the job on a predicted OOM."""

from __future__ import annotations

import shlex
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml
from headroom_process import run_headroom

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "docs" / "examples" / "github-actions-gate.yml"


def headroom_steps() -> list[list[str]]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["gate"]["steps"]
    return [shlex.split(s["run"]) for s in steps if s.get("run", "").startswith("headroom ")]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "headroom"
    return run_headroom(*argv[1:], timeout=120, cwd=cwd)


def test_the_example_workflow_gates_its_spec(tmp_path: Path) -> None:
    gate, junit, fit = headroom_steps()
    assert gate[1] == "gate" and "github" in gate and fit[1] == "fit"
    passed = run(gate, ROOT)
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.startswith("::notice title=Headroom gate::fits")
    out = junit[junit.index("--output") + 1]
    junit[junit.index("--output") + 1] = str(tmp_path / out)
    report = run(junit, ROOT)
    assert report.returncode == 0, report.stderr
    suite = ET.parse(tmp_path / out).getroot()
    assert suite.find(".//testcase") is not None and suite.find(".//failure") is None
    assert run(fit, ROOT).returncode == 0


def test_the_example_gate_fails_the_job_on_a_predicted_oom() -> None:
    gate = headroom_steps()[0]
    failed = run([*gate, "--set", "micro_batch_size=8"], ROOT)
    assert failed.returncode == 1
    assert failed.stdout.startswith("::error title=Headroom gate::oom")
