"""A served run's probes are the run's children, not the service's: another run with a free
place starts while one probes; a cancel ends the probes at once and keeps nothing of them; a
SIGKILLed service leaves no probe running, nor does one that stops; a probe writes nothing
outside its run directory; and no probe starts that this host's RAM could not hold."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import processes
import pytest
from api_client import wait_for
from fastapi.testclient import TestClient
from headroom_process import serve_headroom
from run_rows import AUTH, TINY, TOKEN, run_ended, run_row, run_settings, run_state, sessions_of

from headroom import planner
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch import Supervisor
from headroom.launch.devices import host_ram_available
from headroom.launch.probing import ProbeRefused, autofit, subprocess_prober
from headroom.store import Run

PROBED = {**TINY, "steps": 2, "probe": True}
WAIT_S = 120.0


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return run_settings(tmp_path)


@pytest.fixture
def client(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with TestClient(create_app(settings)) as c:
        yield c


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _descendants(pid: int) -> list[int]:
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _probe_trainers(pid: int) -> list[int]:
    """The probes (``headroom train`` processes) among ``pid``'s descendants."""
    return [
        p for p in _descendants(pid) if processes.running(p) and "-m headroom train" in _cmdline(p)
    ]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_run_with_a_free_place_starts_while_another_probes(client: TestClient) -> None:
    first = client.post("/api/v1/runs", json=PROBED, headers=AUTH).json()
    wait_for(
        lambda: run_state(client, first["id"])["reason"].startswith("probing"),
        timeout=WAIT_S,
        what="the first run to probe",
    )
    second = client.post("/api/v1/runs", json={**TINY, "steps": 2}, headers=AUTH).json()
    wait_for(
        lambda: run_state(client, second["id"])["started_at"] is not None,
        timeout=WAIT_S,
        what="the second run to start",
    )
    # the second (a free place of two) started while the first was still probing
    assert run_state(client, first["id"])["reason"].startswith("probing")
    assert run_ended(client, first["id"])["status"] == "succeeded"
    assert run_ended(client, second["id"])["status"] == "succeeded"


def test_a_cancel_while_probing_ends_the_probes_and_records_nothing(client: TestClient) -> None:
    run = client.post("/api/v1/runs", json=PROBED, headers=AUTH).json()
    pid = wait_for(
        lambda: (r := run_state(client, run["id"]))["reason"].startswith("probing") and r["pid"],
        timeout=WAIT_S,
        what="the probe process's pid",
    )
    trainers = wait_for(lambda: _probe_trainers(pid), timeout=WAIT_S, what="a probe to run")
    for trainer in trainers:  # held: only the cancel can end it now, not its own finish
        os.kill(trainer, signal.SIGSTOP)
    cancelled = client.post(f"/api/v1/runs/{run['id']}/cancel", headers=AUTH).json()
    assert cancelled["status"] == "cancelled"
    assert processes.wait_gone([pid, *trainers], 30) == []
    supervisor = client.app.state.supervisor  # type: ignore[attr-defined]
    wait_for(lambda: run["id"] not in supervisor.children, what="the run to be let go")
    final = run_state(client, run["id"])
    assert final["status"] == "cancelled" and "probes" not in final["plan"]
    assert client.get("/api/v1/calibrations").json()["items"] == []


def test_a_sigkilled_service_leaves_no_probe_running(tmp_path: Path) -> None:
    env = {
        "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/runs.db",
        "HEADROOM_TOKEN": TOKEN,
        "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
        "HEADROOM_RUN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    with serve_headroom(env, tmp_path / "serve.log") as served:
        created = httpx.post(f"{served.url}/api/v1/runs", json=PROBED, headers=AUTH, timeout=30)
        assert created.status_code == 201, created.text
        service = served.process.pid
        trainers = wait_for(lambda: _probe_trainers(service), timeout=WAIT_S, what="a probe to run")
        probing = [p for p in _descendants(service) if processes.running(p)]
        for pid in probing:  # held: only the service's death can end them now
            os.kill(pid, signal.SIGSTOP)
        os.kill(service, signal.SIGKILL)
        assert processes.wait_gone([*probing, *trainers], 30) == []


def test_a_service_that_stops_while_a_run_probes_ends_its_probes(settings: Settings) -> None:
    """A supervisor that closes (the service shutting down) ends a run's probes with it, and the
    run says so."""
    sessions = sessions_of(settings)
    with sessions() as session:
        row = run_row("probed", planner.gpu("H100-80GB"), status="queued")
        row.plan = {**row.plan, "probe": True}
        session.add(row)
        session.commit()
    supervisor = Supervisor(sessions, settings)
    supervisor.tick()
    (child,) = supervisor.children.values()
    assert child.probing and child.proc is not None
    pid = child.proc.pid
    wait_for(lambda: _probe_trainers(pid), timeout=WAIT_S, what="a probe to run")
    group = [pid, *_descendants(pid)]
    supervisor.close()
    assert processes.wait_gone(group, 30) == []
    with sessions() as session:
        run = session.query(Run).filter_by(uid="probed").one()
    assert run.status == "failed" and "probes" not in run.plan
    assert run.reason == "stopped: the service shut down while it probed"


def test_a_probe_writes_nothing_outside_its_run_directory(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "system-tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen: set[str] = set()
    with TestClient(create_app(settings)) as client:
        run = client.post("/api/v1/runs", json=PROBED, headers=AUTH).json()

        def ended() -> dict[str, Any] | None:
            seen.update(os.listdir(scratch))  # looked at all along: a probe's files are brief
            state = run_state(client, run["id"])
            return state if state["status"] in ("succeeded", "failed", "cancelled") else None

        done = wait_for(ended, timeout=WAIT_S, what="the probed run to end")
    assert done["status"] == "succeeded", done["reason"]
    assert done["plan"]["probes"][-1]["outcome"]["ok"]
    assert seen == set()
    directory = Path(settings.run_dir) / run["uid"]
    assert (directory / "probes.json").is_file()
    assert "Warning" not in (directory / "log.txt").read_text()  # the probe process ran clean


def test_no_probe_starts_that_this_hosts_ram_could_not_hold() -> None:
    """The check a CPU run passes applies to each probe: the ladder's plan for an 8B model on
    an H100 is far more than this host's RAM, so the probe is refused, not started."""
    spec = planner.load_model("llama-3-8b")
    hw = planner.gpu("H100-80GB")
    train = planner.TrainSpec(micro_batch_size=1, seq_len=1024)
    fit = planner.fit(spec, train, hw)
    assert fit.budget is not None
    available = host_ram_available()
    assert available is not None and fit.budget.gpu.peak_bytes > available  # the premise
    prober = subprocess_prober("llama-3-8b", hw, "cpu")
    plan = planner.TrainSpec.model_validate(fit.plan)
    with pytest.raises(ProbeRefused, match=r"refused: a probe on the CPU needs about"):
        prober(plan, fit.budget)
    result = autofit(spec, train, hw, prober)
    assert not result.fits and result.probes == []
    assert result.reason.startswith("probe 1 not run: refused: a probe on the CPU needs")
