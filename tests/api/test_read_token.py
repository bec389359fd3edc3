"""``HEADROOM_REQUIRE_TOKEN_FOR_READS``: off (the default) the stored records are public to
read; on, every read of them needs the bearer token too, and the OpenAPI says so. Planning,
the page, the docs and the health checks stay open either way; writes always need the token."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from headroom_process import run_headroom
from pydantic import ValidationError

from headroom.api import Settings, create_app

TOKEN = "read-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: every read of stored records
READS = [
    "/api/v1/calibrations",
    "/api/v1/calibrations/1",
    "/api/v1/coefficients",
    "/api/v1/runs",
    "/api/v1/runs/1",
    "/api/v1/runs/1/logs",
]
OPEN = ["/healthz", "/readyz", "/", "/api/v1/presets", "/api/v1/docs", "/api/v1/openapi.json"]


def _client(tmp_path: Path, **settings: bool) -> Iterator[TestClient]:
    app = create_app(
        Settings(
            database_url=f"sqlite:///{tmp_path / 'r.db'}",
            token=TOKEN,
            launch_runs=False,
            run_dir=tmp_path / "runs",
            **settings,
        )
    )
    with TestClient(app) as client:
        # one run to read (queued; nothing launches it)
        body = {"model": "tiny-dense", "steps": 1, "uid": "read-1"}
        assert client.post("/api/v1/runs", json=body, headers=AUTH).status_code == 201
        yield client
    app.state.engine.dispose()


@pytest.fixture
def public(tmp_path: Path) -> Iterator[TestClient]:
    yield from _client(tmp_path)


@pytest.fixture
def private(tmp_path: Path) -> Iterator[TestClient]:
    yield from _client(tmp_path, require_token_for_reads=True)


def _not_found_or_ok(status: int) -> bool:
    return status in (200, 404)  # no calibration 1: the read got through to the store


def test_by_default_reads_are_public(public: TestClient) -> None:
    for path in READS:
        assert _not_found_or_ok(public.get(path).status_code), path
    openapi = public.get("/api/v1/openapi.json").json()
    assert "security" not in openapi["paths"]["/api/v1/runs"]["get"]


def test_with_the_option_every_read_needs_the_token(private: TestClient) -> None:
    for path in READS:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = private.get(path, headers=headers)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
        assert _not_found_or_ok(private.get(path, headers=AUTH).status_code), path
    assert private.get("/api/v1/runs", headers=AUTH).json()["total"] == 1


def test_with_the_option_the_openapi_declares_the_token_on_reads(private: TestClient) -> None:
    paths = private.get("/api/v1/openapi.json").json()["paths"]
    for path in ("/api/v1/runs", "/api/v1/calibrations", "/api/v1/runs/{run_id}/logs"):
        assert paths[path]["get"]["security"] == [{"HTTPBearer": []}], path
    assert "security" not in paths["/api/v1/presets"]["get"]


def test_with_the_option_planning_the_page_and_health_stay_open(private: TestClient) -> None:
    for path in OPEN:
        assert private.get(path).status_code == 200, path
    assert private.post("/api/v1/estimate", json={"model": "tiny-dense"}).status_code == 200


def test_the_option_without_a_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="require_token_for_reads"):
        Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", require_token_for_reads=True)
    env = {"HEADROOM_REQUIRE_TOKEN_FOR_READS": "true", "HEADROOM_TOKEN": ""}
    result = run_headroom("serve", "--port", "1", env={**os.environ, **env})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: HEADROOM_REQUIRE_TOKEN_FOR_READS: needs HEADROOM_TOKEN to be set as well "
        "(else nothing could read), got 'true'"
    )
