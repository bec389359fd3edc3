"""Fit and probe: a plan that runs out of memory on the (simulated) device is recorded, the
margin widens and the ladder steps down to a plan that runs; ``headroom fit --probe``'s JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from headroom_process import run_headroom
from sqlalchemy import select

from headroom import planner
from headroom.launch.probing import autofit, subprocess_prober, widened_margin
from headroom.launch.recording import probe_recorder
from headroom.planner.ladder import _plan, candidate_key, candidates, ladder_keys
from headroom.store import Calibration, open_store

#: a device of 8 MiB with no context or allocator slack: the CPU probes' simulated card
SIM_GPU = {
    "name": "sim-8MiB",
    "memory_bytes": 8 * 2**20,
    "bf16_flops": 1e12,
    "memory_bandwidth_bytes_per_s": 1e11,
    "host_link": "memory copy",
    "host_link_bytes_per_s": 1e10,
    "cuda_context_bytes": 0,
    "allocator_overhead_fraction": 0.0,
}
TRAIN = {
    "micro_batch_size": 8,
    "seq_len": 128,
    "precision": {"params": "fp32", "grads": "fp32", "master": "none"},
}


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("HEADROOM_DATABASE_URL", url)
    return url


def test_an_oom_probe_is_recorded_and_the_ladder_steps_down(store_url: str) -> None:
    hw = planner.Hardware(**SIM_GPU)
    spec = planner.load_model("tiny-dense")
    train = planner.load_train(TRAIN)
    # coefficients that under-predict activations five-fold: the first plan cannot run
    low = planner.Coefficients(
        profile="textbook",
        attention_scale=0.2,
        mlp_scale=0.2,
        norm_scale=0.2,
        logits_bytes_per_element=1,
        logits_backward_bytes_per_element=1,
    )
    sessions = open_store()
    result = autofit(
        spec,
        train,
        hw,
        subprocess_prober("tiny-dense", hw, "cpu"),
        coefficients=low,
        max_probes=4,
        record=probe_recorder(sessions, spec, hw),
    )
    first, last = result.probes[0], result.probes[-1]
    assert first.outcome.oom and first.outcome.exit_code == 3
    assert first.predicted_peak_bytes <= hw.memory_bytes  # the ladder believed it fit
    assert first.outcome.measured_peak_bytes is not None
    assert first.outcome.measured_peak_bytes > hw.memory_bytes  # and it did not
    assert result.fits and last.outcome.ok and len(result.probes) >= 2
    assert all(p.outcome.oom for p in result.probes[:-1])
    margins = [p.margin_pct for p in result.probes]
    assert margins == sorted(margins) and margins[1] > margins[0]
    # the widened margin covers the error the failed probe proved
    proven = (first.outcome.measured_peak_bytes / first.predicted_peak_bytes - 1) * 100
    assert margins[1] >= proven
    assert result.plan is not None
    plans = {json.dumps(p.changes, sort_keys=True) for p in result.probes}
    assert len(plans) == len(result.probes)  # no plan was probed twice
    # every probe is a calibration record; the failed one says its bytes are a lower bound
    with sessions() as session:
        rows = list(session.scalars(select(Calibration).order_by(Calibration.id)))
    assert [r.uid for r in rows] == [p.calibration_uid for p in result.probes]
    assert all(r.source == "probe" for r in rows)
    assert "out of memory" in rows[0].notes and rows[0].relative_error < 0
    assert rows[-1].measured_peak_bytes == last.outcome.measured_peak_bytes


def test_the_margin_after_an_oom_exceeds_the_proven_error() -> None:
    assert widened_margin(0, 100, 120, None) == 25  # needed > capacity: 20 % + a step
    assert widened_margin(0, 100, 120, 150) == 55  # measured past capacity: 50 % + a step
    assert widened_margin(40, 100, 120, None) == 45  # never narrower than before + a step


def test_ladder_keys_of_a_plan_are_its_candidate_key() -> None:
    spec = planner.load_model("tiny-moe")
    train = planner.TrainSpec(micro_batch_size=4, parallel={"dp": 2, "ep": 2})
    for _, keys in candidates(spec, train):
        assert candidate_key(ladder_keys(_plan(train, keys))) == candidate_key(keys)


def test_fit_probe_json_contract(tmp_path: Path, store_url: str) -> None:
    gpu = tmp_path / "sim.json"
    gpu.write_text(json.dumps(SIM_GPU))
    train = tmp_path / "train.json"
    train.write_text(json.dumps(TRAIN))
    args = ["tiny-dense", "--train", str(train), "--gpu", str(gpu), "--probe"]
    proc = run_headroom(
        "fit",
        *args,
        "--probe-device",
        "cpu",
        "--format",
        "json",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode in (0, 1), proc.stderr
    out = json.loads(proc.stdout)
    for key in ("plan", "budget", "predicted_step_seconds", "candidates_considered", "rejected"):
        assert key in out
    assert out["probes"] and out["fits"] == (proc.returncode == 0)
    if out["fits"]:
        assert out["probes"][-1]["outcome"]["ok"]
        assert planner.TrainSpec.model_validate(out["plan"])
    sessions = open_store()
    with sessions() as session:
        stored = list(session.scalars(select(Calibration)))
    assert len(stored) == len(out["probes"])


def test_fit_probe_refuses_a_model_the_runtime_cannot_build(tmp_path: Path) -> None:
    proc = run_headroom("fit", "gpt3-175b", "--probe", "--no-record", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")


def test_a_cuda_probe_records_its_context_for_calibrate_fit(store_url: str) -> None:
    """A GPU run's attribution (reserved bytes, what the device used beyond them) becomes the
    record's reserved bytes and ``cuda_context`` bucket, which ``calibrate fit`` reads."""
    from headroom.calibration.refit import allocator_overheads, contexts
    from headroom.launch.probing import ProbeOutcome

    hw = planner.load_hardware("H200-141GB")
    spec = planner.load_model("tiny-dense")
    train = planner.load_train(TRAIN)
    outcome = ProbeOutcome(
        exit_code=0,
        ok=True,
        oom=False,
        seconds=1.0,
        measured_peak_bytes=400 << 20,
        peak_phase="backward",
        reserved_peak_bytes=440 << 20,
        attribution={"forward_transient_bytes": 100 << 20, "context_bytes": 610 << 20},
    )
    sessions = open_store()
    uid = probe_recorder(sessions, spec, hw, "runtime")(
        train, planner.estimate(spec, train, hw), outcome
    )
    with sessions() as session:
        rows = list(session.scalars(select(Calibration)))
    assert [r.uid for r in rows] == [uid]
    assert rows[0].measured["buckets"] == {"cuda_context": 610 << 20}
    assert contexts(rows) == {hw.name: (610 << 20, 1)}
    assert allocator_overheads(rows) == {hw.name: (0.1, 1)}
