"""The store over HTTP: bearer-token writes, idempotent records, 404/401/413 problems, readiness,
metrics, runs and coefficient sets, on migrated SQLite and PostgreSQL databases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.store import head_revision

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RECORD = {
    "uid": "rec-1",
    "model": "tiny-dense",
    "train": {"micro_batch_size": 2, "seq_len": 512},
    "gpu": "H100-80GB",
    "measured": {"allocated_bytes": 150_000_000, "reserved_bytes": 170_000_000},
    "source": "runtime",
}


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a new PostgreSQL database (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/t.db"
        return
    import psycopg

    name = f"headroom_store_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL at 127.0.0.1:5432 (database test) is not reachable: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=database_url, token=TOKEN, launch_runs=False))
    with TestClient(app) as c:  # the lifespan migrates the database
        yield c


def _problem(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    assert response.headers["content-type"].startswith(  # type: ignore[attr-defined]
        "application/problem+json"
    )
    body = response.json()  # type: ignore[attr-defined]
    assert body["status"] == status and body["title"] and body["detail"]
    return body  # type: ignore[no-any-return]


def test_writes_without_a_configured_token_are_refused(tmp_path: Path) -> None:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/open.db"))
    with TestClient(app) as c:
        body = _problem(c.post("/api/v1/calibrations", json=RECORD, headers=AUTH), 401)
        assert "HEADROOM_TOKEN" in str(body["detail"])
        assert c.get("/api/v1/calibrations").json()["total"] == 0


def test_writes_need_the_right_token(client: TestClient) -> None:
    _problem(client.post("/api/v1/calibrations", json=RECORD), 401)
    wrong = {"Authorization": "Bearer nope"}
    response = client.post("/api/v1/calibrations", json=RECORD, headers=wrong)
    assert _problem(response, 401)["detail"] == "invalid bearer token"
    assert response.headers["www-authenticate"] == "Bearer"
    _problem(client.post("/api/v1/runs", json={"model": "tiny-dense"}), 401)
    _problem(client.post("/api/v1/runs/1/cancel"), 401)


def test_calibration_record_compares_with_the_estimate(client: TestClient) -> None:
    response = client.post("/api/v1/calibrations", json=RECORD, headers=AUTH)
    assert response.status_code == 201, response.text
    record = response.json()
    budget = planner.estimate(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=2, seq_len=512),
        planner.gpu("H100-80GB"),
    )
    peak = budget.gpu.buckets
    allocated = sum(v for k, v in peak.items() if k not in ("cuda_context", "allocator_overhead"))
    assert record["predicted_peak_bytes"] == allocated
    assert record["measured_peak_bytes"] == 150_000_000
    assert record["relative_error"] == pytest.approx((allocated - 150_000_000) / 150_000_000)
    comparison = record["predicted"]["comparison"]
    assert comparison["phase"] == budget.peak_phase
    assert comparison["measured_reserved_bytes"] == 170_000_000
    assert record["predicted"]["budget"] == budget.model_dump(mode="json")

    fetched = client.get(f"/api/v1/calibrations/{record['id']}").json()
    assert fetched == record
    listing = client.get("/api/v1/calibrations", params={"model": "tiny-dense"}).json()
    assert listing["total"] == 1 and listing["items"][0]["uid"] == "rec-1"
    assert client.get("/api/v1/calibrations", params={"gpu": "A100-40GB"}).json()["total"] == 0


def test_posting_the_same_uid_again_returns_the_stored_record(client: TestClient) -> None:
    first = client.post("/api/v1/calibrations", json=RECORD, headers=AUTH)
    again = client.post("/api/v1/calibrations", json=RECORD, headers=AUTH)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert client.get("/api/v1/calibrations").json()["total"] == 1


def test_invalid_record_names_the_field(client: TestClient) -> None:
    bad = {**RECORD, "measured": {"allocated_bytes": -5}}
    body = _problem(client.post("/api/v1/calibrations", json=bad, headers=AUTH), 422)
    assert "measured.allocated_bytes" in str(body["detail"])
    bad_bucket = {**RECORD, "measured": {"allocated_bytes": 5, "buckets": {"weights": 1}}}
    body = _problem(client.post("/api/v1/calibrations", json=bad_bucket, headers=AUTH), 422)
    assert "measured.buckets" in str(body["detail"])
    bad_train = {**RECORD, "train": {"recompute": "sometimes"}}
    body = _problem(client.post("/api/v1/calibrations", json=bad_train, headers=AUTH), 422)
    assert "recompute" in str(body["detail"])


def test_missing_rows_are_404_problems(client: TestClient) -> None:
    _problem(client.get("/api/v1/calibrations/12345"), 404)
    _problem(client.get("/api/v1/runs/12345"), 404)
    _problem(client.get("/api/v1/runs/12345/logs"), 404)
    _problem(client.post("/api/v1/runs/12345/cancel", headers=AUTH), 404)
    _problem(client.get("/api/v1/no-such-route"), 404)


def test_oversized_bodies_are_413(client: TestClient) -> None:
    big = b'{"model": "' + b"x" * 2_000_000 + b'"}'
    _problem(
        client.post("/api/v1/estimate", content=big, headers={"content-type": "application/json"}),
        413,
    )

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams
        yield b'{"model": "'
        for _ in range(40):
            yield b"y" * 50_000
        yield b'"}'

    _problem(
        client.post(
            "/api/v1/estimate", content=chunks(), headers={"content-type": "application/json"}
        ),
        413,
    )


def test_runs_are_queued_listed_and_cancelled(client: TestClient) -> None:
    body = {"uid": "run-1", "model": "tiny-moe", "train": {"micro_batch_size": 2}, "steps": 5}
    created = client.post("/api/v1/runs", json=body, headers=AUTH)
    assert created.status_code == 201, created.text
    run = created.json()
    assert run["status"] == "queued" and run["steps"] == 5 and run["model_name"] == "tiny-moe"
    assert run["plan"]["train"]["micro_batch_size"] == 2
    assert client.post("/api/v1/runs", json=body, headers=AUTH).status_code == 200
    assert client.get("/api/v1/runs", params={"status": "queued"}).json()["total"] == 1
    assert client.get(f"/api/v1/runs/{run['id']}/logs").text == ""
    cancelled = client.post(f"/api/v1/runs/{run['id']}/cancel", headers=AUTH).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert client.get("/api/v1/runs", params={"status": "queued"}).json()["total"] == 0
    _problem(client.post("/api/v1/runs", json={"model": "no-such-model"}, headers=AUTH), 422)


def test_a_run_the_trainer_cannot_keep_is_refused_before_it_is_queued(
    client: TestClient,
) -> None:
    train = {"precision": {"master": "none"}, "offload": {"mode": "streaming"}}
    body = {"model": "tiny-dense", "train": train, "fit": False}
    problem = _problem(client.post("/api/v1/runs", json=body, headers=AUTH), 422)
    assert "precision.master" in str(problem["detail"])
    assert client.get("/api/v1/runs").json()["total"] == 0


def test_coefficients_list_the_shipped_profiles(client: TestClient) -> None:
    sets = client.get("/api/v1/coefficients").json()
    assert {s["profile"] for s in sets} == set(planner.profiles())
    textbook = next(s for s in sets if s["profile"] == "textbook")
    assert textbook["id"] is None and textbook["calibrated"] is False


def test_gate_verdicts(client: TestClient) -> None:
    fits = client.post("/api/v1/gate", json={"model": "tiny-dense", "gpu": "H100-80GB"}).json()
    assert (fits["decision"], fits["exit_code"], fits["fits"]) == ("fits", 0, True)
    oom = client.post("/api/v1/gate", json={"model": "llama-3-70b", "gpu": "RTX-4090"})
    assert oom.status_code == 200
    assert (oom.json()["decision"], oom.json()["exit_code"]) == ("oom", 1)
    undecided = client.post(
        "/api/v1/gate", json={"model": "tiny-dense", "require_calibration": True}
    ).json()
    assert (undecided["decision"], undecided["exit_code"], undecided["fits"]) == (
        "undecided",
        3,
        None,
    )
    tight = client.post(
        "/api/v1/gate", json={"model": "llama-3-8b", "gpu": "H200-141GB", "margin_pct": 100}
    ).json()
    assert tight["decision"] == "oom" and tight["margin_bytes"] == tight["gpu_peak_bytes"]


def test_health_readiness_and_metrics(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/api/v1/readyz")
    assert ready.status_code == 200 and ready.json()["revision"] == head_revision()
    client.post("/api/v1/estimate", json={"model": "tiny-dense"})
    client.post("/api/v1/calibrations", json=RECORD, headers=AUTH)
    text = client.get("/metrics").text
    assert 'headroom_estimates_total{endpoint="estimate"} 1.0' in text
    assert "headroom_calibrations_total 1.0" in text
    assert "http_requests_total" in text


def test_not_ready_before_migrations(tmp_path: Path) -> None:
    app = create_app(
        Settings(
            database_url=f"sqlite:///{tmp_path}/bare.db",
            token=TOKEN,
            migrate=False,
            launch_runs=False,
        )
    )
    with TestClient(app) as c:
        ready = c.get("/readyz")
        body = _problem(ready, 503)
        assert f"expected {head_revision()}" in str(body["detail"])
        assert ready.headers["Retry-After"].isdigit()  # a probe knows when to ask again


def test_local_gpus_says_why_there_are_none(client: TestClient) -> None:
    body = client.get("/api/v1/gpus").json()
    assert isinstance(body["gpus"], list)
    if not body["gpus"]:
        assert body["reason"]


def test_fit_returns_a_plan_that_fits(client: TestClient) -> None:
    body = {"model": "llama-3-8b", "train": {"micro_batch_size": 8}, "gpu": "H100-80GB"}
    result = client.post("/api/v1/fit", json=body).json()
    assert result["fits"] is True and result["budget"]["fits"] is True
    assert result["plan"]["offload"]["mode"] in ("optimizer", "streaming")
    assert result["candidates_considered"] > 100
    expected = planner.fit(
        planner.load_model("llama-3-8b"),
        planner.TrainSpec(micro_batch_size=8),
        planner.gpu("H100-80GB"),
    )
    assert result == expected.model_dump(mode="json")
    nothing = client.post(
        "/api/v1/fit", json={"model": "deepseek-v3", "gpu": "RTX-3090", "host_memory": "64GiB"}
    )
    assert nothing.status_code == 200 and nothing.json()["fits"] is False


def test_an_empty_token_setting_counts_as_no_token(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path}/e.db", token="  ")
    assert settings.token is None
    with TestClient(create_app(settings)) as c:
        response = c.post("/api/v1/calibrations", json=RECORD, headers={"Authorization": "Bearer "})
        _problem(response, 401)
