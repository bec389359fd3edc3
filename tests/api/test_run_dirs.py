"""Run directories are private to the service's user, and removed some days after their runs
end when ``HEADROOM_RUN_RETENTION_DAYS`` says so.

They used to be created with the process's umask (0755 directories, 0644 logs, specs and
reports: readable by every user of the host) and were never removed.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_client import wait_for
from fastapi.testclient import TestClient

from headroom import planner, store
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch.supervisor import this_process
from headroom.store import Run

TOKEN = "dirs-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = {"model": "tiny-dense", "train": {"seq_len": 16, "micro_batch_size": 1}}


@pytest.fixture
def shared_umask() -> Iterator[None]:
    """The umask most hosts give a service: what it creates is readable by everyone."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_run_directory_and_its_files_are_private(
    tmp_path: Path, shared_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/runs.db",
        token=TOKEN,
        run_dir=tmp_path / "runs",
        run_device="cpu",
    )
    with TestClient(create_app(settings)) as client:
        run = client.post("/api/v1/runs", json={**TINY, "steps": 2}, headers=AUTH).json()
        done = wait_for(
            lambda: (
                (r := client.get(f"/api/v1/runs/{run['id']}").json())["status"] == "succeeded" and r
            ),
            what="the run to succeed",
        )
    directory = tmp_path / "runs" / done["uid"]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
    # the service's files, and the one the trainer wrote itself
    assert {"model.json", "train.json", "log.txt", "report.json"} <= set(files), files
    assert all(mode & 0o077 == 0 for mode in files.values()), {n: oct(m) for n, m in files.items()}


def _row(uid: str, status: str, finished_ago: dt.timedelta | None, **values: Any) -> Run:
    model = planner.load_model("tiny-dense")
    hardware = planner.gpu("H100-80GB")
    plan = {
        "model": model.model_dump(mode="json"),
        "train": planner.TrainSpec().model_dump(mode="json"),
        "hardware": hardware.model_dump(mode="json"),
    }
    now = store.utcnow()
    return Run(
        uid=uid,
        status=status,
        model_name=model.name,
        gpu_name=hardware.name,
        plan=plan,
        steps=2,
        started_at=now - dt.timedelta(days=30),
        finished_at=None if finished_ago is None else now - finished_ago,
        **values,
    )


def test_retention_removes_the_directories_of_runs_that_ended_long_ago(
    database_url: str, tmp_path: Path
) -> None:
    base = tmp_path / "runs"
    settings = Settings(
        database_url=database_url,
        token=TOKEN,
        run_dir=base,
        run_device="cpu",
        run_retention_days=7,
    )
    store.upgrade(database_url)
    days = dt.timedelta(days=1)
    rows = {
        "old-succeeded": _row("old-succeeded", "succeeded", 10 * days),
        "old-failed": _row("old-failed", "failed", 8 * days),
        "old-cancelled": _row("old-cancelled", "cancelled", 30 * days),
        "recent": _row("recent", "failed", days / 24),
        "recent-no-log": _row("recent-no-log", "failed", days / 24),
        # still running (its supervisor is this process, alive): never removed
        "running": _row("running", "running", None, owner=this_process(), pid=1),
    }
    for uid, row in rows.items():
        (base / uid).mkdir(parents=True)
        if uid != "recent-no-log":
            (base / uid / "log.txt").write_text(f"the log of {uid}")
        row.log_path = str(base / uid / "log.txt")
    (base / "not-a-run").mkdir()  # not Headroom's: left alone
    sessions = store.make_sessionmaker(store.make_engine(database_url))
    with sessions() as session:
        session.add_all(rows.values())
        session.commit()
        ids = {r.uid: r.id for r in session.query(Run)}

    old = {"old-succeeded", "old-failed", "old-cancelled"}
    with TestClient(create_app(settings)) as client:  # its supervisor sweeps as it starts
        wait_for(
            lambda: not any((base / uid).exists() for uid in old),
            timeout=20,
            what="the directories of runs that ended over 7 days ago to be removed",
        )
        assert sorted(p.name for p in base.iterdir()) == [
            "not-a-run",
            "recent",
            "recent-no-log",
            "running",
        ]
        for uid in old:
            assert client.get(f"/api/v1/runs/{ids[uid]}").json()["status"] == rows[uid].status
            gone = client.get(f"/api/v1/runs/{ids[uid]}/logs")
            assert gone.status_code == 410, gone.text
            assert gone.headers["content-type"] == "application/problem+json"
            detail = gone.json()["detail"]
            assert "removed" in detail and "HEADROOM_RUN_RETENTION_DAYS" in detail, detail
        assert client.get(f"/api/v1/runs/{ids['recent']}/logs").text == "the log of recent"
        empty = client.get(f"/api/v1/runs/{ids['recent-no-log']}/logs")
        assert (empty.status_code, empty.text) == (200, "")


def test_without_retention_run_directories_are_kept(tmp_path: Path) -> None:
    base = tmp_path / "runs"
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/runs.db", token=TOKEN, run_dir=base, run_device="cpu"
    )
    assert settings.run_retention_days is None
    store.upgrade(settings.database_url)
    (base / "ancient").mkdir(parents=True)
    (base / "ancient" / "log.txt").write_text("kept")
    sessions = store.make_sessionmaker(store.make_engine(settings.database_url))
    with sessions() as session:
        row = _row("ancient", "succeeded", dt.timedelta(days=3650))
        row.log_path = str(base / "ancient" / "log.txt")
        session.add(row)
        session.commit()
        run_id = row.id
    with TestClient(create_app(settings)) as client:
        time.sleep(1)  # the supervisor's first pass is over
        assert client.get(f"/api/v1/runs/{run_id}/logs").text == "kept"
    assert (base / "ancient" / "log.txt").exists()


@pytest.mark.parametrize("value", ["0", "-1", "a week"])
def test_retention_must_be_a_positive_number_of_days(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADROOM_RUN_RETENTION_DAYS", value)
    with pytest.raises(ValueError, match="run_retention_days"):
        Settings()
