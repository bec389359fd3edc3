"""How the service answers a request it cannot read: a JSON body cut short names the body and
where it broke, a margin that is not a finite number says so, a body that is not JSON is 415."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

TOKEN = "request-errors-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {**AUTH, "Content-Type": "application/json"}
#: the routes that read a JSON body, each with a body it accepts
ROUTES = {
    "estimate": {"model": "tiny-dense"},
    "gate": {"model": "tiny-dense"},
    "fit": {"model": "tiny-dense"},
    "calibrations": {"model": "tiny-dense"},
    "runs": {"model": "tiny-dense"},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("request-errors") / "r.db"
    with service_client(f"sqlite:///{db}", TOKEN) as c:
        yield c


def problem_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_truncated_body_names_the_body_and_where_it_broke(client: TestClient, path: str) -> None:
    content = b'{"model": "tiny-dense",\n "gpu": "H1'
    problem = problem_of(client.post(f"/api/v1/{path}", content=content, headers=JSON), 422)
    fields = [e["field"] for e in problem["errors"]]
    assert fields == ["body"], problem  # not the character offset "35"
    assert problem["detail"].startswith("body: "), problem
    assert "line 2, column 9" in problem["detail"], problem
    assert "character 32" in problem["detail"], problem


@pytest.mark.parametrize("path", ["gate", "fit"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_margin_that_is_not_finite_says_so(client: TestClient, path: str, value: bytes) -> None:
    content = b'{"model": "tiny-dense", "margin_pct": ' + value + b"}"
    problem = problem_of(client.post(f"/api/v1/{path}", content=content, headers=JSON), 422)
    assert [e["field"] for e in problem["errors"]] == ["margin_pct"], problem
    assert "finite number from 0 to 100" in problem["detail"], problem
    assert "less than or equal" not in problem["detail"], problem


@pytest.mark.parametrize("path", ["gate", "fit"])
def test_a_margin_in_range_is_still_taken(client: TestClient, path: str) -> None:
    response = client.post(f"/api/v1/{path}", json={"model": "tiny-dense", "margin_pct": 12.5})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml", None]
)
def test_a_body_that_is_not_json_is_415(
    client: TestClient, path: str, content_type: str | None
) -> None:
    headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
    content = b'{"model": "tiny-dense"}'
    problem = problem_of(client.post(f"/api/v1/{path}", content=content, headers=headers), 415)
    assert "application/json" in problem["detail"], problem
    assert str(content_type) in problem["detail"] if content_type else True


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/x+json"])
def test_json_media_types_are_still_taken(client: TestClient, content_type: str) -> None:
    headers = {**AUTH, "Content-Type": content_type}
    response = client.post("/api/v1/estimate", content=b'{"model": "tiny-dense"}', headers=headers)
    assert response.status_code == 200, response.text


def test_openapi_documents_415_on_the_json_routes(client: TestClient) -> None:
    paths = client.get("/api/v1/openapi.json").json()["paths"]
    for path in ROUTES:
        responses = paths[f"/api/v1/{path}"]["post"]["responses"]
        assert list(responses["415"]["content"]) == ["application/problem+json"]


def test_a_body_with_thousands_of_mistakes_gets_a_bounded_answer(client: TestClient) -> None:
    """50,000 unknown keys gave a 3.09 MB answer listing every one; the answer lists 20 and
    counts the rest, and a huge key is not echoed whole."""
    body = {"model": "tiny-dense", "gpu": "H100-80GB", **{f"k{i}": 1 for i in range(50_000)}}
    response = client.post("/api/v1/estimate", json=body)
    assert response.status_code == 422
    assert len(response.content) < 16_384
    problem = response.json()
    assert len(problem["errors"]) == 20 and problem["errors_total"] == 50_000
    assert problem["detail"].endswith("; and 49980 more")
    huge = client.post("/api/v1/estimate", json={"model": "tiny-dense", "x" * 100_000: 1})
    assert huge.status_code == 422 and len(huge.content) < 4096
    assert huge.json()["errors"][0]["field"].endswith("…")
