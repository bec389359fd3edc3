"""Runs launched on Slurm (``backend: slurm``) against a real one-node cluster: through
``headroom launch --backend slurm`` and ``POST /runs``, a run is a batch job whose id the store
keeps, watched to its end (completed, out of memory, killed by a signal, cancelled through the
API or from Slurm's side), its log served by the API; a stopped service leaves its jobs running
and the next supervisor takes them over by job id."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import processes
import pytest
from api_client import wait_for
from fastapi.testclient import TestClient
from run_rows import AUTH, TINY, run_ended, run_row, run_settings, run_state, sessions_of

from headroom import planner, store
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch import Supervisor, slurm, transitions
from headroom.store import Run

TINY_SETS = ["--set", "seq_len=16", "--set", "micro_batch_size=1"]
WAIT_S = 120.0


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return run_settings(tmp_path)


@pytest.fixture
def on_the_cluster(cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's Slurm commands go to the test cluster (as ``SLURM_CONF`` points a
    service at its cluster)."""
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return cluster


@pytest.fixture
def client(settings: Settings, on_the_cluster: dict[str, str]) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def _job_in(job_id: str, states: frozenset[str]) -> slurm.JobState:
    return wait_for(  # type: ignore[no-any-return]
        lambda: (job := slurm.job_state(job_id)) is not None and job.state in states and job,
        timeout=WAIT_S,
        what=f"slurm job {job_id} in {sorted(states)}",
    )


def _run_dir(client: TestClient) -> Path:
    """The served app's RUN_DIR."""
    return Path(client.app.state.settings.run_dir)  # type: ignore[attr-defined]


def _launch(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``headroom launch``, bound: past ``WAIT_S`` it and what it started are killed."""
    return processes.run(
        [sys.executable, "-m", "headroom", "launch", "tiny-dense", *TINY_SETS, *args],
        timeout=WAIT_S,
        env={
            **env,
            "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/runs.db",
            "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
            "OMP_NUM_THREADS": "1",
        },
    )


def test_headroom_launch_backend_slurm_runs_a_two_rank_job_to_completion(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    """``parallel.dp: 2`` on one node: the job runs the trainer as two data-parallel ranks
    under torchrun (gloo), to completion."""
    done = _launch(
        tmp_path, cluster, "--set", "parallel.dp=2", "--steps", "2", "--backend", "slurm",
        "--slurm-time-limit", "00:10:00", "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)["run"]
    assert run["status"] == "succeeded" and run["backend"] == "slurm", run
    assert run["reason"] == "completed 2 step(s)" and run["job_id"].isdigit()
    directory = Path(run["log_path"]).parent
    script = (directory / "job.sbatch").read_text()
    assert "#SBATCH --time=00:10:00" in script and f"#SBATCH --chdir={directory}" in script
    assert "--nproc-per-node 2" in script and "torch.distributed.run" in script
    report = json.loads((directory / "report.json").read_text())  # rank 0's
    assert len(report["losses"]) == 2 and report["placement"]["data_parallel"] == 2


def test_headroom_launch_backend_slurm_probe_probes_inside_the_job(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    """``--probe`` with ``--backend slurm``: the job probes on its node, not the command on
    the host it was typed on."""
    done = _launch(
        tmp_path, cluster, "--steps", "2", "--backend", "slurm", "--probe", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["run"]["status"] == "succeeded", out["run"]
    assert out["probes"] and out["probes"][-1]["outcome"]["ok"]
    directory = Path(out["run"]["log_path"]).parent
    assert "-m headroom.launch.probe_process" in (directory / "job.sbatch").read_text()
    assert (directory / "probes.json").is_file()


def test_a_slurm_allocation_without_the_slurm_backend_is_refused_naming_the_option(
    tmp_path: Path,
) -> None:
    refused = _launch(tmp_path, dict(os.environ), "--slurm-partition", "gpu")
    assert refused.returncode == 2
    assert "--slurm-partition" in refused.stderr and "--backend slurm" in refused.stderr
    bad = _launch(tmp_path, dict(os.environ), "--backend", "slurm", "--slurm-account", "a;b")
    assert bad.returncode == 2 and "--slurm-account" in bad.stderr, bad.stderr
    setting = _launch(
        tmp_path, {**os.environ, "HEADROOM_SLURM_TIME_LIMIT": "soon"}, "--backend", "slurm"
    )
    assert setting.returncode == 2 and "HEADROOM_SLURM_TIME_LIMIT" in setting.stderr
    assert "'soon'" in setting.stderr and not (tmp_path / "runs.db").exists()


def test_post_runs_backend_slurm_is_a_job_whose_log_the_api_serves(client: TestClient) -> None:
    created = client.post(
        "/api/v1/runs",
        json={**TINY, "steps": 2, "backend": "slurm", "slurm": {"time_limit": "00:05:00"}},
        headers=AUTH,
    )
    assert created.status_code == 201, created.text
    assert created.json()["plan"]["slurm"] == {"time_limit": "00:05:00", "nodes": 1}
    done = run_ended(client, created.json()["id"])
    assert done["status"] == "succeeded" and done["job_id"].isdigit(), done
    assert done["pid"] is None and done["exit_code"] == 0
    log = client.get(f"/api/v1/runs/{done['id']}/logs").text
    assert len(json.loads(log[log.index("{") :])["losses"]) == 2


def test_a_slurm_allocation_for_another_backend_or_unsafe_is_a_422(client: TestClient) -> None:
    for body in (
        {**TINY, "backend": "local", "slurm": {"partition": "gpu"}},
        {**TINY, "backend": "slurm", "slurm": {"partition": "gpu; rm -rf /"}},
        {**TINY, "backend": "slurm", "slurm": {"nodes": 0}},
    ):
        refused = client.post("/api/v1/runs", json=body, headers=AUTH)
        assert refused.status_code == 422, refused.text
        assert "slurm" in refused.text
    assert client.get("/api/v1/runs").json()["total"] == 0


def test_cancelling_a_slurm_run_scancels_its_job(client: TestClient) -> None:
    run = client.post(
        "/api/v1/runs", json={**TINY, "steps": 10_000_000, "backend": "slurm"}, headers=AUTH
    ).json()
    job_id = wait_for(lambda: run_state(client, run["id"])["job_id"], what="the job's submission")
    _job_in(job_id, frozenset({"RUNNING"}))
    cancelled = client.post(f"/api/v1/runs/{run['id']}/cancel", headers=AUTH).json()
    assert cancelled["status"] == "cancelled" and cancelled["reason"] == "cancelled by request"
    assert _job_in(job_id, slurm.ENDED).state == "CANCELLED"
    assert run_state(client, run["id"])["status"] == "cancelled"


def test_a_slurm_run_whose_trainer_is_killed_ends_failed_with_the_signal(
    client: TestClient,
) -> None:
    run = client.post(
        "/api/v1/runs", json={**TINY, "steps": 10_000_000, "backend": "slurm"}, headers=AUTH
    ).json()
    job_id = wait_for(lambda: run_state(client, run["id"])["job_id"], what="the job's submission")
    _job_in(job_id, frozenset({"RUNNING"}))
    # the trainer, found by its run's uid on the node (this machine), killed outright
    pid = wait_for(
        lambda: next(
            (
                int(p)
                for p in subprocess.run(
                    ["pgrep", "-f", f"headroom train .*{run['uid']}"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.split()
            ),
            None,
        ),
        what="the trainer's process",
    )
    os.kill(pid, signal.SIGKILL)
    done = run_ended(client, run["id"])
    assert done["status"] == "failed", done
    assert done["reason"] == f"slurm job {job_id}: killed by SIGKILL", done["reason"]
    assert done["exit_code"] == -signal.SIGKILL


def _queued_row(uid: str, hardware: planner.Hardware, steps: int) -> Run:
    train = planner.TrainSpec(micro_batch_size=1, seq_len=16)
    return run_row(uid, hardware, train, steps=steps, backend="slurm", status="queued")


def _supervised(supervisor: Supervisor, until: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not until():
        assert time.monotonic() < deadline, "the supervisor never saw it"
        supervisor.tick()
        time.sleep(0.2)


def test_a_slurm_job_out_of_memory_ends_the_run_failed_with_the_phase(
    settings: Settings, on_the_cluster: dict[str, str]
) -> None:
    """The planned card is smaller than the run needs (queued past the gate, as a stale plan
    would be): the job's trainer runs out of memory and the run says where, from its report."""
    sessions = sessions_of(settings)
    small = planner.Hardware(
        **{**planner.gpu("RTX-3090").model_dump(), "name": "sim-1MiB", "aliases": ()},
    ).model_copy(update={"memory_bytes": 2**20, "cuda_context_bytes": 0})
    with sessions() as session:
        session.add(_queued_row("slurm-oom", small, steps=2))
        session.commit()
    supervisor = Supervisor(sessions, settings)
    supervisor.tick()
    assert set(supervisor.children)  # submitted
    _supervised(supervisor, lambda: not supervisor.children)
    with sessions() as session:
        run = session.query(Run).filter_by(uid="slurm-oom").one()
    assert run.status == "failed" and run.exit_code == 3, run.reason
    assert run.reason.startswith("out of memory in ") and run.job_id is not None


def test_a_stopped_service_leaves_its_slurm_jobs_running_and_the_next_takes_them_over(
    settings: Settings, on_the_cluster: dict[str, str]
) -> None:
    sessions = sessions_of(settings)
    with sessions() as session:
        session.add(_queued_row("slurm-adopted", planner.gpu("H100-80GB"), steps=10_000_000))
        session.commit()
    first = Supervisor(sessions, settings)
    first.tick()
    with sessions() as session:
        run = session.query(Run).filter_by(uid="slurm-adopted").one()
    assert run.job_id is not None and run.status == "running"
    job_id = run.job_id
    _job_in(job_id, frozenset({"RUNNING"}))
    first.close()  # the service stops: its job runs on
    job = slurm.job_state(job_id)
    assert job is not None and job.state == "RUNNING"
    # a service process that has exited owned it (as after a restart)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    with sessions() as session:
        row = session.query(Run).filter_by(uid="slurm-adopted").one()
        assert row.status == "running"
        row.owner = f"{first.owner.split(':')[0]}:{int(gone.stdout)}:1"
        session.commit()
    second = Supervisor(sessions, settings)
    assert second.reconcile() == 0  # nothing ended: the job is taken over, not stopped
    assert set(second.children) == {run.id}
    assert Supervisor(sessions, settings).reconcile() == 0  # and taken once
    slurm.cancel(job_id)  # ended from Slurm's side, not through Headroom
    _supervised(second, lambda: not second.children)
    with sessions() as session:
        row = session.query(Run).filter_by(uid="slurm-adopted").one()
    assert row.status == "failed" and row.owner == second.owner
    assert row.reason == (
        f"slurm job {job_id}: cancelled in Slurm (scancel, preemption or an administrator)"
    )


def test_a_slurm_job_runs_parallel_dp_ranks_over_its_nodes(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``parallel.dp`` ranks split over the run's nodes (torchrun's ranks per node); a data
    parallelism the nodes cannot split evenly is not submitted, saying why."""
    sessions = sessions_of(settings)
    scripts: list[str] = []

    def submit(script: Path, env: Any = None) -> str:
        scripts.append(script.read_text())
        raise slurm.SlurmError("sbatch: not submitted by this test")

    monkeypatch.setattr(slurm, "submit", submit)
    hw = planner.gpu("H100-80GB")
    with sessions() as session:
        for uid, dp, nodes in (("dp4-on-2", 4, 2), ("dp3-on-2", 3, 2)):
            row = _queued_row(uid, hw, steps=2)
            row.plan = {
                **row.plan,
                "train": {**row.plan["train"], "parallel": {"dp": dp}},
                "slurm": {"nodes": nodes},
            }
            session.add(row)
        session.commit()
    Supervisor(sessions, settings).tick()
    with sessions() as session:
        runs = {r.uid: r for r in session.query(Run)}
    assert len(scripts) == 1
    assert "#SBATCH --nodes=2" in scripts[0] and "--nproc-per-node 2" in scripts[0]
    assert runs["dp4-on-2"].reason == "could not submit: sbatch: not submitted by this test"
    assert runs["dp3-on-2"].status == "failed"
    assert runs["dp3-on-2"].reason == (
        "could not submit: parallel.dp: 3 ranks do not split evenly over 2 nodes; allowed: a "
        "multiple of 2"
    )


def test_a_slurm_job_of_a_silent_supervisor_on_another_host_is_taken_over(
    settings: Settings,
) -> None:
    """A replica on another host (whose processes this host cannot see) that stopped beating
    for ``owner_timeout_s`` leaves its Slurm jobs to a replica here; one that beats keeps them,
    and a process-run there is left to its own host."""
    sessions = sessions_of(settings)
    hw = planner.gpu("H100-80GB")
    now = store.utcnow()
    long_ago = now - dt.timedelta(seconds=settings.owner_timeout_s + 60)
    elsewhere = "another-host:4242:1:cafe"
    with sessions() as session:
        for uid, seen, job_id in (
            ("silent-job", long_ago, "101"),
            ("beating-job", now, "102"),
            ("silent-process", long_ago, None),
        ):
            where = {"job_id": job_id, "backend": "slurm"} if job_id else {"pid": 4242}
            row = run_row(uid, hw, status="running", owner=elsewhere, owner_seen_at=seen, **where)
            session.add(row)
        session.commit()
    here = Supervisor(sessions, settings)
    assert here.reconcile() == 0  # nothing ended: one job taken over, the rest left alone
    with sessions() as session:
        runs = {r.uid: r for r in session.query(Run)}
    assert set(here.children) == {runs["silent-job"].id}
    assert here.children[runs["silent-job"].id].job_id == "101"
    assert runs["silent-job"].owner == here.owner and runs["silent-job"].status == "running"
    assert runs["beating-job"].owner == elsewhere
    assert runs["silent-process"].owner == elsewhere and runs["silent-process"].status == "running"
    # the new owner beats for it from now on
    with sessions() as session:
        assert transitions.heartbeat(session, here.owner) == 1


def test_a_probed_slurm_run_probes_inside_its_job_then_trains_the_confirmed_plan(
    client: TestClient,
) -> None:
    """``probe: true`` on Slurm: the job runs the probe ladder on its node before the trainer
    (not the service on its host); the probes are recorded as calibrations once they end."""
    created = client.post(
        "/api/v1/runs",
        json={**TINY, "steps": 2, "backend": "slurm", "probe": True},
        headers=AUTH,
    )
    assert created.status_code == 201, created.text
    done = run_ended(client, created.json()["id"])
    assert done["status"] == "succeeded" and done["reason"] == "completed 2 step(s)", done
    directory = _run_dir(client) / done["uid"]
    script = (directory / "job.sbatch").read_text()
    ladder = script.index("-m headroom.launch.probe_process")
    assert ladder < script.index("exec srun") and "--device cpu" in script[ladder:]
    log = client.get(f"/api/v1/runs/{done['id']}/logs").text
    assert "probes: probe 1 ran the plan into step 2" in log
    probes = done["plan"]["probes"]
    assert probes and probes[-1]["outcome"]["ok"]
    records = client.get("/api/v1/calibrations").json()["items"]
    assert [r["uid"] for r in records] == [p["calibration_uid"] for p in probes]


def test_a_slurm_runs_probe_the_node_cannot_hold_is_refused_there(client: TestClient) -> None:
    """The host RAM check of a CPU run applies to a probe in a job too, on its node: the ladder's
    plan for an 8B model on an H100 needs far more than this node's RAM, so the job ends
    without starting it, and the run says why."""
    created = client.post(
        "/api/v1/runs",
        json={
            "model": "llama-3-8b",
            "gpu": "H100-80GB",
            "train": {"seq_len": 1024, "micro_batch_size": 1},
            "backend": "slurm",
            "probe": True,
        },
        headers=AUTH,
    )
    assert created.status_code == 201, created.text
    done = run_ended(client, created.json()["id"])
    assert done["status"] == "failed" and done["job_id"], done
    assert done["reason"].startswith(
        "no plan confirmed by probes: probe 1 not run: refused: a probe on the CPU needs about "
    ), done["reason"]
    assert done["plan"]["probes"] == []
    assert client.get("/api/v1/calibrations").json()["items"] == []
