"""A run's files stay under RUN_DIR, and row ids answer the same on both databases.

A run uid of ``.`` or ``..`` used to name RUN_DIR itself or its parent: the run wrote its specs
and report there and ``GET /runs/{id}/logs`` read that directory's ``log.txt``. Such uids are
refused where runs are created, and every run path is resolved under RUN_DIR, so even a row
stored with such a uid cannot escape. Ids beyond the id columns' range (PostgreSQL's 32-bit
``integer``) were a 500 there and a 404 on SQLite; the path schema now bounds them (422).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from headroom import launch, planner, store
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch import Supervisor
from headroom.store import Run

TOKEN = "paths-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = {"model": "tiny-dense", "train": {"seq_len": 16, "micro_batch_size": 1}}
#: what a run writes into its directory
RUN_FILES = ("model.json", "train.json", "report.json", "log.txt")
BAD_UIDS = [".", "..", ".hidden", "a/b", "../x", "a\\b"]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path}/runs.db",
        token=TOKEN,
        run_dir=tmp_path / "base" / "runs",
        run_device="cpu",
        max_running=2,
    )


def _sessions(settings: Settings) -> sessionmaker[Session]:
    return store.open_store(settings.database_url)


def _row(uid: str, **values: Any) -> Run:
    model = planner.load_model("tiny-dense")
    train = planner.TrainSpec(micro_batch_size=1, seq_len=16)
    hardware = planner.gpu("H100-80GB")
    plan = {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "hardware": hardware.model_dump(mode="json"),
    }
    return Run(uid=uid, model_name=model.name, gpu_name=hardware.name, plan=plan, steps=2, **values)


def _outside(settings: Settings) -> list[Path]:
    """Run files written outside RUN_DIR (in its parent or the parent's parent)."""
    base = Path(settings.run_dir)
    return [
        d / name
        for d in (base.parent, base.parent.parent)
        for name in RUN_FILES
        if (d / name).exists()
    ]


@pytest.mark.parametrize("uid", BAD_UIDS)
def test_a_run_uid_that_is_not_a_plain_name_is_422(settings: Settings, uid: str) -> None:
    with TestClient(create_app(settings)) as client:
        response = client.post("/api/v1/runs", json={**TINY, "uid": uid}, headers=AUTH)
        assert response.status_code == 422, response.text
        problem = response.json()
        assert [e["field"] for e in problem["errors"]] == ["uid"], problem
        assert "uid: " in problem["detail"] and "pattern" in problem["detail"], problem
        time.sleep(0.5)  # a queued run would have been started by now
        assert client.get("/api/v1/runs").json()["total"] == 0
    assert _outside(settings) == []


@pytest.mark.parametrize("uid", BAD_UIDS)
def test_the_launch_layer_refuses_a_bad_uid(settings: Settings, uid: str) -> None:
    plan = launch.RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=1, seq_len=16),
        planner.gpu("H100-80GB"),
    )
    with _sessions(settings)() as session:
        with pytest.raises(planner.SpecError) as refused:
            launch.queue_run(
                session=session, plan=plan, steps=2, backend="local", gate=True, uid=uid
            )
        assert refused.value.field == "uid" and "allowed" in str(refused.value)
        assert session.query(Run).count() == 0


@pytest.mark.parametrize("uid", [".", ".."])
def test_a_stored_bad_uid_is_not_launched_outside_run_dir(settings: Settings, uid: str) -> None:
    """A row written past the checks (an older release, by hand) still cannot escape."""
    sessions = _sessions(settings)
    with sessions() as session:
        session.add(_row(uid, status="queued"))
        session.commit()
    supervisor = Supervisor(sessions, settings)
    try:
        supervisor.tick()
    finally:
        supervisor.close()
    with sessions() as session:
        run = session.query(Run).one()
    assert run.status == "failed", run.reason
    assert "could not start" in run.reason and "run directory" in run.reason, run.reason
    assert run.pid is None and run.log_path is None
    assert _outside(settings) == []
    assert not (Path(settings.run_dir) / "model.json").exists()


def test_logs_are_not_read_outside_run_dir(settings: Settings) -> None:
    base = Path(settings.run_dir)
    base.mkdir(parents=True)
    secret = base.parent / "log.txt"
    secret.write_text("not a run's log")
    elsewhere = base.parent / "other" / "log.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text("not a run's log either")
    sessions = _sessions(settings)
    with sessions() as session:
        # what the release before this one stored for uid "..", and a path set by hand
        session.add(_row("..", status="failed", log_path=str(base / ".." / "log.txt")))
        session.add(_row("hand", status="failed", log_path=str(elsewhere)))
        session.add(_row("ok", status="failed", log_path=str(base / "ok" / "log.txt")))
        session.commit()
        ids = {r.uid: r.id for r in session.query(Run)}
    (base / "ok").mkdir()
    (base / "ok" / "log.txt").write_text("the run's own log")
    app = create_app(settings.model_copy(update={"launch_runs": False}))
    with TestClient(app) as client:
        for uid in ("..", "hand"):
            response = client.get(f"/api/v1/runs/{ids[uid]}/logs")
            assert "not a run's log" not in response.text
            assert response.status_code == 404, response.text
            assert "run directory" in response.json()["detail"]
        assert client.get(f"/api/v1/runs/{ids['ok']}/logs").text == "the run's own log"


# --- ids beyond the id columns --------------------------------------------------------------


@pytest.fixture
def any_client(database_url: str) -> Iterator[TestClient]:
    with service_client(database_url, TOKEN) as c:
        yield c


#: the id columns are ``Integer``: 32-bit on PostgreSQL
MAX_ID = 2**31 - 1
ROW_ROUTES = [
    ("get", "/api/v1/runs/{}"),
    ("get", "/api/v1/runs/{}/logs"),
    ("post", "/api/v1/runs/{}/cancel"),
    ("get", "/api/v1/calibrations/{}"),
]


def test_ids_beyond_the_id_column_are_422_on_both_backends(any_client: TestClient) -> None:
    for method, route in ROW_ROUTES:
        for row_id in (MAX_ID + 1, 2**31, 2**62, 2**63):
            response = any_client.request(method, route.format(row_id), headers=AUTH)
            assert response.status_code == 422, (route, row_id, response.text)
            problem = response.json()
            assert [e["field"] for e in problem["errors"]] == [
                "path." + route.split("/")[3].removesuffix("s") + "_id"
            ], problem
            assert str(MAX_ID) in problem["detail"], problem
        # the largest id the column holds is a plain miss
        largest = any_client.request(method, route.format(MAX_ID), headers=AUTH)
        assert largest.status_code == 404, (route, largest.text)


def test_openapi_states_the_id_range(any_client: TestClient) -> None:
    spec = any_client.get("/api/v1/openapi.json").json()
    bounded = [
        (path, param["schema"])
        for path, operations in spec["paths"].items()
        for operation in operations.values()
        for param in operation.get("parameters", [])
        if param["in"] == "path" and param["name"].endswith("_id")
    ]
    assert len(bounded) == len(ROW_ROUTES)
    for path, schema in bounded:
        assert (schema["minimum"], schema["maximum"]) == (1, MAX_ID), (path, schema)


# --- ids written one way ---------------------------------------------------------------------

#: texts an int parse read as a row id: runs 1, 1, 1, 1, 10 and 1
NOT_DECIMAL = ["1.0", "%201", "1%20", "+1", "01", "1_0", "1e0", "0x1", "%EF%BC%91"]


def test_a_path_id_is_decimal_digits_or_a_422_naming_it(any_client: TestClient) -> None:
    """``POST /runs/1.0/cancel`` cancelled run 1: an id is 1 to MAX_ID in decimal digits
    without a sign, spaces, a fraction or leading zeros; any other text is a 422 naming the
    path parameter and the allowed form, and touches no row."""
    run = any_client.post("/api/v1/runs", json={**TINY, "fit": False}, headers=AUTH).json()
    record = {"model": "tiny-dense", "measured": {"allocated_bytes": 2**30}}
    calibration = any_client.post("/api/v1/calibrations", json=record, headers=AUTH).json()
    assert (run["id"], calibration["id"]) == (1, 1)
    for method, route in ROW_ROUTES:
        name = route.split("/")[3].removesuffix("s") + "_id"
        for text in NOT_DECIMAL:
            response = any_client.request(method, route.format(text), headers=AUTH)
            assert response.status_code == 422, (method, route, text, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert [e["field"] for e in problem["errors"]] == [f"path.{name}"], problem
            assert f"allowed: 1 to {MAX_ID} in decimal digits" in problem["detail"], problem
    assert any_client.get("/api/v1/runs/1").json()["status"] == "queued"  # not cancelled
    for method, route in ROW_ROUTES:  # written as digits, the same ids are served
        assert any_client.request(method, route.format(1), headers=AUTH).status_code == 200
    assert any_client.get("/api/v1/runs/1").json()["status"] == "cancelled"
