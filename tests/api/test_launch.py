"""Runs launched by the service: the lifecycle persisted at each step, logs captured, both
launcher backends, cancel ending the process group, a killed or out-of-memory trainer ending
failed with its reason, and runs orphaned by a stopped service reconciled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import processes
import pytest
from api_client import wait_for
from fastapi.testclient import TestClient
from run_rows import AUTH, TINY, gone, run_ended, run_row, run_settings, run_state, sessions_of

from headroom import planner
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch import Supervisor
from headroom.launch.supervisor import this_process
from headroom.store import Run


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return run_settings(tmp_path)


@pytest.fixture
def client(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("backend", ["local", "torchrun"])
def test_a_run_is_fitted_launched_and_succeeds(client: TestClient, backend: str) -> None:
    created = client.post(
        "/api/v1/runs", json={**TINY, "steps": 2, "backend": backend}, headers=AUTH
    )
    assert created.status_code == 201, created.text
    run = created.json()
    assert run["status"] == "queued" and run["plan"]["fit"]["candidates_considered"] > 0
    # priced by the bundled trainer's own profile (the request named none)
    assert run["plan"]["train"]["activation_profile"] == "runtime"
    done = run_ended(client, run["id"])
    assert done["status"] == "succeeded", done
    assert done["exit_code"] == 0 and done["reason"] == "completed 2 step(s)"
    assert done["device"] == "cpu" and done["pid"] and done["backend"] == backend
    assert done["started_at"] and done["finished_at"]
    log = client.get(f"/api/v1/runs/{run['id']}/logs").text
    report = json.loads(log[log.index("{") :])  # the trainer printed its report
    assert len(report["losses"]) == 2


def test_a_torchrun_run_trains_parallel_dp_ranks(client: TestClient) -> None:
    """``backend: torchrun`` starts the run's ``parallel.dp`` data-parallel ranks."""
    body = {**TINY, "train": {**TINY["train"], "parallel": {"dp": 2}}}
    created = client.post(
        "/api/v1/runs", json={**body, "steps": 2, "backend": "torchrun"}, headers=AUTH
    )
    assert created.status_code == 201, created.text
    done = run_ended(client, created.json()["id"])
    assert done["status"] == "succeeded", done["reason"]
    log = client.get(f"/api/v1/runs/{done['id']}/logs").text
    report = json.loads(log[log.index("{") :])
    assert report["placement"]["data_parallel"] == 2 and len(report["losses"]) == 2


def test_cancel_ends_the_whole_process_group(client: TestClient) -> None:
    run = client.post("/api/v1/runs", json={**TINY, "steps": 10_000_000}, headers=AUTH).json()
    running = wait_for(
        lambda: (r := run_state(client, run["id"]))["pid"] and r, what="the trainer to start"
    )
    pid = running["pid"]
    assert running["status"] == "running" and not gone(pid, group=True)
    cancelled = client.post(f"/api/v1/runs/{run['id']}/cancel", headers=AUTH).json()
    assert cancelled["status"] == "cancelled" and cancelled["reason"] == "cancelled by request"
    wait_for(lambda: gone(pid, group=True), timeout=30, what="the process group to end")
    # the trainer's end is still recorded, and the run stays cancelled
    final = wait_for(
        lambda: (r := run_state(client, run["id"]))["exit_code"] is not None and r,
        what="the exit code",
    )
    assert final["status"] == "cancelled" and final["exit_code"] == -signal.SIGTERM


def test_a_killed_trainer_ends_failed_with_the_signal(client: TestClient) -> None:
    run = client.post("/api/v1/runs", json={**TINY, "steps": 10_000_000}, headers=AUTH).json()
    pid = wait_for(lambda: run_state(client, run["id"])["pid"], what="the trainer to start")
    os.kill(pid, signal.SIGKILL)
    done = run_ended(client, run["id"])
    assert done["status"] == "failed" and done["exit_code"] == -signal.SIGKILL
    assert done["reason"] == "killed by SIGKILL"


def test_nothing_predicted_to_oom_is_queued(client: TestClient) -> None:
    refused = client.post(
        "/api/v1/runs",
        json={"model": "llama-3-70b", "gpu": "RTX-3090", "fit": False},
        headers=AUTH,
    )
    assert refused.status_code == 422
    assert "predicted out of memory" in str(refused.json()["detail"])
    dropout = client.post("/api/v1/runs", json={"model": "gpt3-175b"}, headers=AUTH)
    assert dropout.status_code == 422 and "dropout" in str(dropout.json()["detail"])
    assert client.get("/api/v1/runs").json()["total"] == 0


def test_a_trainer_out_of_memory_ends_failed_with_the_phase(settings: Settings) -> None:
    """The planned card is smaller than the run needs (queued past the gate, as a stale plan
    would be): the trainer runs out of memory on the simulated device and the run says where."""
    sessions = sessions_of(settings)
    small = planner.Hardware(
        **{**planner.gpu("RTX-3090").model_dump(), "name": "sim-1MiB", "aliases": ()},
    ).model_copy(update={"memory_bytes": 2**20, "cuda_context_bytes": 0})
    with sessions() as session:
        session.add(run_row("oom-run", small))
        session.commit()
    supervisor = Supervisor(sessions, settings)
    supervisor.tick()
    wait_for(lambda: (supervisor.tick(), not supervisor.children)[1], what="the trainer to end")
    with sessions() as session:
        run = session.query(Run).filter_by(uid="oom-run").one()
    assert run.status == "failed" and run.exit_code == 3
    assert run.reason.startswith("out of memory in ") and "(exit 3)" in run.reason


def test_runs_orphaned_by_a_stopped_service_are_reconciled(settings: Settings) -> None:
    sessions = sessions_of(settings)
    hw = planner.gpu("H100-80GB")
    # a service process that has exited: its owner tag no longer names a live process
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    dead_owner = f"{this_process().split(':')[0]}:{int(gone.stdout)}:1"
    # 1. its trainer is still alive (its command line names the run): it is ended
    with processes.started(
        [sys.executable, "-c", "import time; time.sleep(120)", "orphan-run"]
    ) as orphan:  # in a session of its own, as a trainer; stopped whatever the test does
        # 2. its trainer finished while the service was down: the report says so
        finished_dir = Path(settings.run_dir) / "finished-run"
        finished_dir.mkdir(parents=True)
        (finished_dir / "report.json").write_text(json.dumps({"losses": [1.0, 0.9]}))
        with sessions() as session:
            common = {"status": "running", "owner": dead_owner}
            session.add(run_row("orphan-run", hw, pid=orphan.pid, **common))
            session.add(
                run_row(
                    "finished-run",
                    hw,
                    pid=999_999,
                    log_path=str(finished_dir / "log.txt"),
                    **common,
                )
            )
            session.add(run_row("lost-run", hw, pid=999_998, **common))
            session.commit()
        assert Supervisor(sessions, settings).reconcile() == 3
        orphan.wait(timeout=10)
        assert orphan.returncode == -signal.SIGTERM
    with sessions() as session:
        rows = {r.uid: r for r in session.query(Run)}
    assert (
        rows["orphan-run"].status == "failed" and "trainer was ended" in rows["orphan-run"].reason
    )
    assert rows["finished-run"].status == "succeeded"
    assert "while its service was down" in rows["finished-run"].reason
    assert rows["lost-run"].status == "failed" and "exit status was lost" in rows["lost-run"].reason
    # a live owner's runs are left alone
    with sessions() as session:
        session.add(run_row("live-run", hw, status="running", owner=this_process(), pid=1))
        session.commit()
    assert Supervisor(sessions, settings).reconcile() == 0


def test_a_probed_run_records_its_probe_and_launches_the_confirmed_plan(
    client: TestClient,
) -> None:
    run = client.post("/api/v1/runs", json={**TINY, "steps": 2, "probe": True}, headers=AUTH).json()
    done = run_ended(client, run["id"])
    assert done["status"] == "succeeded", done
    probes = done["plan"]["probes"]
    assert probes and probes[-1]["outcome"]["ok"]
    assert done["plan"]["train"]["micro_batch_size"] >= 1
    records = client.get("/api/v1/calibrations").json()["items"]
    assert [r["uid"] for r in records] == [p["calibration_uid"] for p in probes]
    assert all(r["source"] == "probe" for r in records)
