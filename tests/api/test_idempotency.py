"""Writes under a client's uid, on SQLite and PostgreSQL: the same request again is a 200 with
the stored record, another request under the uid a 409 problem naming the uid and what differs,
an invalid body a 422 whatever its uid names; racing writers, on one service or two, get one
201; and runs stored before runs kept their request still answer sanely.

Re-posting a uid used to return the stored record whatever the new body said: a different
measurement (or run) was dropped with a 200, and an invalid body got a 200 as well."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

from headroom import planner, store
from headroom.api import idempotency
from headroom.planner.measurement import Measurement
from headroom.store import Calibration, migrate

TOKEN = "uid-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RECORD = {
    "uid": "rec-1",
    "model": "tiny-dense",
    "train": {"micro_batch_size": 2, "seq_len": 512},
    "gpu": "H100-80GB",
    "measured": {"allocated_bytes": 150_000_000, "reserved_bytes": 170_000_000},
    "source": "runtime",
}
RUN = {"uid": "run-1", "model": "tiny-dense", "train": {"micro_batch_size": 2}, "steps": 5}


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    with service_client(database_url, TOKEN) as c:
        yield c


def _conflict(response: Any, uid: str) -> dict[str, Any]:
    assert response.status_code == 409, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert (problem["status"], problem["field"], problem["uid"]) == (409, "uid", uid), problem
    assert f"uid: {uid!r} names " in problem["detail"], problem
    return problem


@pytest.mark.parametrize(
    "same",
    [
        RECORD,
        # the same request written otherwise: a GPU alias in another case, the default notes
        # given, a whole number written as a float, the keys in another order
        {
            **dict(reversed(RECORD.items())),
            "gpu": "H100",
            "notes": "",
            "measured": {"reserved_bytes": 170_000_000.0, "allocated_bytes": 150_000_000},
        },
    ],
)
def test_the_same_calibration_again_is_the_stored_record(
    client: TestClient, same: dict[str, Any]
) -> None:
    first = client.post("/api/v1/calibrations", json=RECORD, headers=AUTH)
    again = client.post("/api/v1/calibrations", json=same, headers=AUTH)
    assert (first.status_code, again.status_code) == (201, 200), again.text
    assert again.json() == first.json()
    assert client.get("/api/v1/calibrations").json()["total"] == 1


@pytest.mark.parametrize(
    ("other", "differs"),
    [
        ({"measured": {"allocated_bytes": 160_000_000}}, ["measured.allocated_bytes"]),
        ({"notes": "second try"}, ["notes"]),
        ({"source": "probe"}, ["source"]),
        ({"train": {"micro_batch_size": 4, "seq_len": 512}}, ["train.micro_batch_size"]),
    ],
)
def test_another_calibration_under_a_stored_uid_is_a_409(
    client: TestClient, other: dict[str, Any], differs: list[str]
) -> None:
    first = client.post("/api/v1/calibrations", json=RECORD, headers=AUTH).json()
    if "measured" in other:  # the reserved bytes stay: only the allocated ones differ
        other = {"measured": {**RECORD["measured"], **other["measured"]}}
    conflict = _conflict(
        client.post("/api/v1/calibrations", json={**RECORD, **other}, headers=AUTH), "rec-1"
    )
    assert conflict["differs"] == differs, conflict
    assert f"calibration record {first['id']}" in conflict["detail"]
    # the stored record is untouched, and nothing else was stored
    assert client.get(f"/api/v1/calibrations/{first['id']}").json() == first
    assert client.get("/api/v1/calibrations").json()["total"] == 1


@pytest.mark.parametrize(
    ("invalid", "field"),
    [
        ({"measured": {"allocated_bytes": -5}}, "measured.allocated_bytes"),
        ({"model": "no-such-model"}, "model"),
        ({"train": {"recompute": "sometimes"}}, "recompute"),
    ],
)
def test_an_invalid_calibration_under_a_stored_uid_is_a_422(
    client: TestClient, invalid: dict[str, Any], field: str
) -> None:
    assert client.post("/api/v1/calibrations", json=RECORD, headers=AUTH).status_code == 201
    response = client.post("/api/v1/calibrations", json={**RECORD, **invalid}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert field in response.json()["detail"], response.text


def test_a_run_under_a_stored_uid_is_the_stored_run_or_a_409_or_a_422(
    client: TestClient,
) -> None:
    first = client.post("/api/v1/runs", json=RUN, headers=AUTH)
    assert first.status_code == 201, first.text
    run = first.json()
    # the same request: the defaults written out, the model as its preset's spec
    spelled_out = {
        **RUN,
        "model": planner.load_model("tiny-dense").model_dump(mode="json"),
        "gpu": "h100-sxm",
        "backend": "local",
        "fit": True,
        "probe": False,
    }
    for same in (RUN, spelled_out):
        again = client.post("/api/v1/runs", json=same, headers=AUTH)
        assert again.status_code == 200, again.text
        assert again.json() == run
    for other, differs in [
        ({"steps": 6}, ["steps"]),
        ({"train": {"micro_batch_size": 1}}, ["train.micro_batch_size"]),
        ({"fit": False}, ["fit"]),
        ({"probe": True}, ["probe"]),
        ({"backend": "torchrun"}, ["backend"]),
        ({"backend": "slurm", "slurm": {"nodes": 2}}, ["backend", "slurm"]),
    ]:
        conflict = _conflict(
            client.post("/api/v1/runs", json={**RUN, **other}, headers=AUTH), "run-1"
        )
        assert conflict["differs"] == differs, (other, conflict)
        assert f"run {run['id']}" in conflict["detail"]
    for invalid, field in [
        ({"steps": 0}, "steps"),
        ({"model": "no-such-model"}, "model"),
        ({"slurm": {"nodes": 2}}, "slurm"),  # an allocation for backend local
    ]:
        response = client.post("/api/v1/runs", json={**RUN, **invalid}, headers=AUTH)
        assert response.status_code == 422, (invalid, response.text)
        assert field in response.json()["detail"], response.text
    assert client.get("/api/v1/runs").json()["total"] == 1


def test_a_slurm_run_without_an_allocation_is_the_one_with_the_default_allocation(
    client: TestClient,
) -> None:
    body = {**RUN, "backend": "slurm"}
    assert client.post("/api/v1/runs", json=body, headers=AUTH).status_code == 201
    for same in ({**body, "slurm": {}}, {**body, "slurm": {"nodes": 1}}):
        assert client.post("/api/v1/runs", json=same, headers=AUTH).status_code == 200
    other = {**body, "slurm": {"partition": "gpu"}}
    assert _conflict(client.post("/api/v1/runs", json=other, headers=AUTH), "run-1")["differs"] == [
        "slurm.partition"
    ]


def _race(clients: list[TestClient], path: str, bodies: list[dict[str, Any]]) -> Counter[int]:
    """Post ``bodies`` at once, one thread each, through ``clients`` in turn; the statuses."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(len(bodies))

    def post(i: int) -> None:
        start.wait()
        response = clients[i % len(clients)].post(path, json=bodies[i], headers=AUTH)
        with lock:
            statuses[response.status_code] += 1

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return statuses


@pytest.mark.parametrize(("path", "body"), [("calibrations", RECORD), ("runs", RUN)])
def test_a_uid_raced_on_two_services_is_stored_once(
    database_url: str, path: str, body: dict[str, Any]
) -> None:
    """Eight writers at once on two services of one database (replicas): the same request
    gives one 201 and seven 200s; then eight other requests under the uid, eight 409s."""
    with service_client(database_url, TOKEN) as one, service_client(database_url, TOKEN) as two:
        same = _race([one, two], f"/api/v1/{path}", [body] * 8)
        assert same == {201: 1, 200: 7}, same
        others = [{**body, "notes": f"writer {i}"} for i in range(8)]
        if path == "runs":
            others = [{**body, "steps": 100 + i} for i in range(8)]
        conflicts = _race([one, two], f"/api/v1/{path}", others)
        assert conflicts == {409: 8}, conflicts
        assert one.get(f"/api/v1/{path}").json()["total"] == 1


def test_a_uid_raced_with_different_requests_stores_one_of_them(database_url: str) -> None:
    with service_client(database_url, TOKEN) as one, service_client(database_url, TOKEN) as two:
        bodies = [{**RECORD, "notes": f"writer {i}"} for i in range(8)]
        statuses = _race([one, two], "/api/v1/calibrations", bodies)
        assert statuses == {201: 1, 409: 7}, statuses
        stored = one.get("/api/v1/calibrations").json()
        assert stored["total"] == 1 and stored["items"][0]["notes"] in {b["notes"] for b in bodies}


def test_runs_stored_before_runs_kept_their_request_answer_sanely(database_url: str) -> None:
    """A run stored before ``runs.request`` (revision 0006) is compared with what its plan
    kept: a gated run's plan is the spec asked for; a fitted run's is the ladder's, so its
    training spec is not compared (nothing else is lost)."""
    gated = {**RUN, "uid": "gated", "fit": False}
    fitted = {**RUN, "uid": "fitted"}
    with service_client(database_url, TOKEN) as client:
        for body in (gated, fitted):
            assert client.post("/api/v1/runs", json=body, headers=AUTH).status_code == 201
    migrate.downgrade(database_url, "0005")  # the request column goes, the runs stay
    migrate.upgrade(database_url)
    with service_client(database_url, TOKEN) as client:
        stored = client.get("/api/v1/runs").json()["items"]
        assert [r["uid"] for r in stored] == ["gated", "fitted"]
        for body in (gated, fitted):
            again = client.post("/api/v1/runs", json=body, headers=AUTH)
            assert again.status_code == 200, again.text
            assert again.json() == next(r for r in stored if r["uid"] == body["uid"])
        other_train = {"train": {"micro_batch_size": 1}}
        conflict = _conflict(
            client.post("/api/v1/runs", json={**gated, **other_train}, headers=AUTH), "gated"
        )
        assert conflict["differs"] == ["train.micro_batch_size"]
        assert (
            client.post("/api/v1/runs", json={**fitted, **other_train}, headers=AUTH).status_code
            == 200
        )
        for body in (gated, fitted):
            conflict = _conflict(
                client.post("/api/v1/runs", json={**body, "steps": 7}, headers=AUTH), body["uid"]
            )
            assert conflict["differs"] == ["steps"]


@pytest.mark.parametrize("gpu", planner.gpu_names())
def test_every_preset_request_reads_back_as_itself(gpu: str) -> None:
    """What a record stores of a request reads back (through today's types) as the request,
    for every model preset and run preset's training spec on every GPU preset."""
    hw = planner.gpu(gpu)
    measured = Measurement(allocated_bytes=2**30, buckets={"params": 2**29})
    trains = [planner.TrainSpec()] + [planner.load_run(n).train for n in planner.run_names()]
    for name in planner.model_names():
        model = planner.load_model(name)
        for train in trains:
            asked = idempotency.calibration_request(
                model=model, train=train, hw=hw, measured=measured, source="trace", notes="n"
            )
            row = Calibration(
                spec=store.spec_dump(model=model, train=train, hw=hw),
                measured=measured.model_dump(mode="json"),
                source="trace",
                notes="n",
            )
            stored = idempotency.stored_calibration_request(row)
            assert idempotency.differences(stored, asked) == [], (name, train)
