"""``headroom calibrate report``: error statistics over committed traces and stored records,
the false-fit count, and the plot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import processes
import pytest
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration.stored import record_measurement
from headroom.planner.measurement import Measurement
from headroom.store import open_store


def test_report_counts_false_fits_and_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/r.db"
    monkeypatch.setenv("HEADROOM_DATABASE_URL", url)
    sessions = open_store()
    model = planner.load_model("tiny-dense")
    train = planner.TrainSpec(micro_batch_size=1, seq_len=32)
    hw = planner.gpu("H100-80GB")
    budget = planner.estimate(model, train, hw)
    assert budget.fits
    peak = budget.gpu_peak_bytes
    with sessions() as session:
        # a probe predicted to fit that ran out of memory: a false fit
        record_measurement(
            session=session,
            uid="probe-oom",
            model=model,
            train=train,
            hw=hw,
            budget=budget,
            measured=Measurement(allocated_bytes=2 * peak),
            source="probe",
            notes="out of memory: the measured bytes are a lower bound",
        )
        record_measurement(
            session=session,
            uid="probe-ok",
            model=model,
            train=train,
            hw=hw,
            budget=budget,
            measured=Measurement(allocated_bytes=peak),
            source="probe",
        )
    png = tmp_path / "report.png"
    args = ["calibrate", "report", "--png", str(png), "--format", "json"]
    proc = run_headroom(*args, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    from headroom.calibration.report import COMMITTED
    from headroom.calibration.trace_records import load_framework_traces

    fsdp2 = load_framework_traces("hf-fsdp2")
    torchtitan = load_framework_traces("torchtitan-fsdp2")
    assert fsdp2 is not None and torchtitan is not None
    committed = sum(len(json.loads(path.read_text())["records"]) for path in COMMITTED)
    assert summary["points"] == committed + len(fsdp2.records) + len(torchtitan.records) + 2
    # per (implementation, framework): the two probes are textbook's without a framework
    pairs = summary["by_pair"]
    assert pairs["textbook / none"]["n"] == 2
    assert pairs["hf / fsdp2"]["n"] == len(fsdp2.records)
    assert pairs["torchtitan / fsdp2"]["n"] == len(torchtitan.records)
    assert summary["false_fits"] == 1
    for key in ("median", "p95", "max"):
        assert summary["peak"][key] is not None
    assert summary["peak"]["max"] >= 0.5  # the false fit's error is in the statistics
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_report_compares_committed_traces_without_importing_torch(
    tmp_path: Path,
) -> None:
    """The committed framework traces are compared with today's estimate by arithmetic alone:
    the report's text loads neither torch nor the tracer (2 s of a report's 3 s went to them)."""
    code = (
        "import sys\n"
        "from headroom.cli import main\n"
        "sys.argv = ['headroom', 'calibrate', 'report', '--format', 'json']\n"
        "code = 0\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, sorted(m for m in ('torch', 'headroom.calibration.tracing') "
        "if m in sys.modules), file=sys.stderr)\n"
    )
    env = os.environ | {"HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/r.db"}
    proc = processes.run([sys.executable, "-c", code], timeout=120, env=env)
    assert proc.stderr.strip().splitlines()[-1] == "0 []", proc.stderr
    assert json.loads(proc.stdout)["points"] > 0
