"""HTTP methods and query parameters as HTTP means them: ``HEAD`` answers like ``GET`` without
a body, a 405 lists in ``Allow`` every method the path is served with, and a query parameter
given twice is a 422 naming it (it was taken silently, the last value winning)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

TOKEN = "methods-token"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("methods") / "m.db"
    with service_client(f"sqlite:///{db}", TOKEN) as c:
        yield c


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/healthz",
        "/api/v1/healthz",
        "/api/v1/presets",
        "/api/v1/runs",
        "/api/v1/docs",
        "/api/v1/openapi.json",
        "/metrics",
    ],
)
def test_head_answers_like_get_without_a_body(client: TestClient, path: str) -> None:
    get, head = client.get(path), client.head(path)
    assert get.status_code == 200 and head.status_code == 200, (get.text, head.text)
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # the counters move between the two requests
        assert head.headers["content-length"] == str(len(get.content))


def test_head_of_a_missing_row_is_its_404(client: TestClient) -> None:
    head = client.head("/api/v1/runs/12345")
    assert head.status_code == 404 and head.content == b""


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("OPTIONS", "/api/v1/runs", "GET, HEAD, POST"),
        ("DELETE", "/api/v1/runs", "GET, HEAD, POST"),
        ("OPTIONS", "/api/v1/calibrations", "GET, HEAD, POST"),
        ("PUT", "/api/v1/calibrations", "GET, HEAD, POST"),
        ("PATCH", "/api/v1/estimate", "POST"),
        ("HEAD", "/api/v1/estimate", "POST"),
        ("GET", "/api/v1/runs/1/cancel", "POST"),
        ("DELETE", "/api/v1/runs/1", "GET, HEAD"),
    ],
)
def test_405_allows_every_method_of_the_path(
    client: TestClient, method: str, path: str, allow: str
) -> None:
    response = client.request(method, path)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allow
    if method != "HEAD":
        problem = response.json()
        assert response.headers["content-type"] == "application/problem+json"
        assert problem["detail"] == f"{method} is not served at {path}; allowed: {allow}"


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("offset=1&offset=2", "offset"),
        ("limit=5&limit=5", "limit"),
        ("status=queued&limit=2&status=failed", "status"),
    ],
)
def test_a_query_parameter_given_twice_is_422_naming_it(
    client: TestClient, query: str, field: str
) -> None:
    response = client.get(f"/api/v1/runs?{query}")
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["errors"] == [
        {"field": f"query.{field}", "message": "given 2 times; give it once"}
    ]


def test_each_list_route_refuses_repeats(client: TestClient) -> None:
    for path in ("/api/v1/calibrations?model=a&model=b", "/api/v1/runs?offset=0&offset=0"):
        assert client.get(path).status_code == 422, path
    assert client.get("/api/v1/runs?offset=0&limit=1").status_code == 200
