"""``POST /api/v1/calibrations/ingest``: GPU runs' logs into calibration records over HTTP, as
``headroom calibrate ingest`` makes them, on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterator

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

from headroom.calibration.logs import GIB, MIB

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
URL = "/api/v1/calibrations/ingest"
#: Megatron-LM's report_memory line (megatron/training/utils/common_utils.py at d98e8a64)
MEGATRON = (
    "[Rank 0] (after 10 iterations) memory (MB) | allocated: 3270.16 | max allocated: 5670.39 "
    "| reserved: 6406.00 | max reserved: 6406.00"
)
RUN = {
    "model": "tiny-dense",
    "train": {
        "micro_batch_size": 1,
        "seq_len": 64,
        "framework": "megatron",
        "activation_profile": "megatron",
    },
    "gpu": "H100-80GB",
}


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    with service_client(database_url, TOKEN) as c:
        yield c


def test_a_log_becomes_a_record_once_with_its_stacks_trust(client: TestClient) -> None:
    body = {**RUN, "logs": [{"name": "train.log", "text": f"start\n{MEGATRON}\n"}]}
    assert client.post(URL, json=body).status_code == 401
    first = client.post(URL, json=body, headers=AUTH)
    assert first.status_code == 201, first.text
    (record,) = first.json()["records"]
    assert record["format"] == "megatron" and record["figure"] == "max_allocated"
    assert record["measured_bytes"] == round(5670.39 * MIB)
    assert record["framework"] == "megatron" and record["gpu"] == "H100-80GB"
    (trust,) = first.json()["trust"]
    assert trust["recent_records"] == 1
    stored = client.get(f"/api/v1/calibrations/{record['id']}").json()
    assert stored["source"] == "log" and stored["measured"]["log_format"] == "megatron"
    again = client.post(URL, json=body, headers=AUTH)
    assert again.status_code == 200 and again.json()["records"][0]["uid"] == record["uid"]
    assert client.get("/api/v1/calibrations").json()["total"] == 1


def test_a_snapshot_comes_as_base64(client: TestClient) -> None:
    trace = [
        {"action": "alloc", "addr": 1, "size": GIB, "stream": 0},
        {"action": "free_completed", "addr": 1, "size": GIB, "stream": 0},
    ]
    snap = {"segments": [], "device_traces": [trace]}
    encoded = base64.b64encode(pickle.dumps(snap)).decode()
    body = {**RUN, "logs": [{"name": "snap.pickle", "base64": encoded}]}
    response = client.post(URL, json=body, headers=AUTH)
    assert response.status_code == 201, response.text
    assert response.json()["records"][0]["measured_bytes"] == GIB


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            {
                **RUN,
                "logs": [
                    {"name": "a.log", "text": MEGATRON},
                    {"name": "b.log", "text": "x\n" + MEGATRON[:-30]},
                ],
            },
            "b.log:2: a Megatron report_memory line cut short",
        ),
        (
            {"logs": [{"name": "a.log", "text": MEGATRON}]},
            "model: a.log is a megatron log of one run",
        ),
        ({**RUN, "logs": [{"name": "a.log", "base64": "not base64!"}]}, "base64 is not valid"),
        ({**RUN, "logs": [{"name": "a.log"}]}, "logs.0"),
        ({**RUN, "format": "wandb", "logs": []}, "format"),
        ({**RUN, "logs": []}, "logs: no log given"),
        (
            {"logs": [{"name": "p.json", "text": '{"runs": [5], "figure": "x"}'}]},
            "p.json: runs[0]: not a published run",
        ),
    ],
    ids=[
        "cut-short",
        "no-model",
        "bad-base64",
        "no-content",
        "unknown-format",
        "no-logs",
        "published-of-another-shape",
    ],
)
def test_what_cannot_be_read_is_a_422_and_nothing_is_stored(
    client: TestClient, body: dict[str, object], says: str
) -> None:
    response = client.post(URL, json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert says in response.json()["detail"]
    assert client.get("/api/v1/calibrations").json()["total"] == 0


def test_the_published_runs_load_as_records(client: TestClient) -> None:
    response = client.post(URL, json={"published": True}, headers=AUTH)
    assert response.status_code == 201, response.text
    out = response.json()
    assert len(out["records"]) >= 60 and all(r["created"] for r in out["records"])
    assert {r["figure"] for r in out["records"]} == {
        "max_allocated",
        "max_reserved",
        "nvidia_smi_total",
    }
    assert client.get("/api/v1/calibrations?limit=1").json()["total"] == len(out["records"])
    sets = client.get("/api/v1/coefficients").json()
    titan = next(s for s in sets if s["profile"] == "torchtitan" and s["id"] is None)
    stacks = {(t["gpu"], t["framework"]): t for t in titan["trust"]}
    assert stacks["H100-80GB", "fsdp2"]["recent_records"] >= 10
    assert all(t["activation_profile"] == "torchtitan" for t in titan["trust"])
