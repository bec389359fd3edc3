"""How the service answers a request it cannot read: a JSON body cut short names the body and
where it broke, a margin that is not a finite number says so, a body that is not JSON is 415."""

from __future__ import annotations

import json
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
    """50,000 unknown keys gave a 3.09 MB answer listing every one, and 0.3 s of CPU making an
    error for each: a planning body that large is not read (413), and thousands of unknown
    keys are one error that names a few and counts them; a body with more mistakes than that
    lists 20 and counts the rest; a huge key is not echoed whole."""
    body = {"model": "tiny-dense", "gpu": "H100-80GB", **{f"k{i}": 1 for i in range(50_000)}}
    response = client.post("/api/v1/estimate", json=body)
    assert response.status_code == 413, response.text
    assert response.json()["detail"] == "request body is larger than 131072 bytes"
    body = {"model": "tiny-dense", "gpu": "H100-80GB", **{f"k{i}": 1 for i in range(8_000)}}
    response = client.post("/api/v1/estimate", json=body)
    assert response.status_code == 422
    assert len(response.content) < 16_384
    problem = response.json()
    assert problem["errors_total"] == 1 and problem["errors"][0]["field"] == "body"
    assert problem["detail"].startswith("body: 8000 unknown fields ('k0', 'k1',")
    assert "allowed: model, train, gpu, host_memory, gpus_per_node" in problem["detail"]
    # twenty unknown keys are still named one by one, beside the other mistakes
    body = {f"k{i}": 1 for i in range(20)} | {"model": 1, "gpus_per_node": 0, "host_memory": []}
    problem = client.post("/api/v1/estimate", json=body).json()
    assert len(problem["errors"]) == 20 and problem["errors_total"] > 20
    assert problem["detail"].endswith(f"; and {problem['errors_total'] - 20} more")
    huge = client.post("/api/v1/estimate", json={"model": "tiny-dense", "x" * 100_000: 1})
    assert huge.status_code == 422 and len(huge.content) < 4096
    assert huge.json()["errors"][0]["field"].endswith("…")


_JUNK = {f"k{i}": 1 for i in range(8_000)}
MOE_MODEL: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_hidden_size": 128,
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32},
}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "tiny-dense", "train": _JUNK}, "train"),
        ({"model": "tiny-dense", "train": {"parallel": _JUNK}}, "train.parallel"),
        ({"model": {"name": "m", **_JUNK}}, "model"),
        ({"model": {**MOE_MODEL, "moe": {**MOE_MODEL["moe"], **_JUNK}}}, "model.moe"),
        ({"model": "tiny-dense", "gpu": {"name": "g", **_JUNK}}, "gpu"),
    ],
    ids=["train", "train.parallel", "model", "model.moe", "gpu"],
)
@pytest.mark.parametrize("route", ["estimate", "gate", "fit"])
def test_thousands_of_unknown_keys_anywhere_are_one_error(
    client: TestClient, route: str, body: dict[str, Any], field: str
) -> None:
    """Nested objects too: one error naming the object, its count and what it allows (each
    unknown key was an error of its own, built and then mostly thrown away)."""
    response = client.post(f"/api/v1/{route}", json=body)
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["field"] == field
    assert problem["detail"].startswith(f"{field}: 8000 unknown fields ('k0', ")
    assert "; allowed: " in problem["detail"] and len(response.content) < 2048


def test_a_planning_body_is_read_up_to_128_kib(client: TestClient) -> None:
    """What the schema can hold fits with room to spare; above it, 413 before the JSON is
    read, declared or streamed."""
    padded = {"model": "tiny-dense", "gpu": {"name": "g", "source": "é" * 4000}}
    assert len(json.dumps(padded)) < 32 << 10
    assert client.post("/api/v1/estimate", json=padded).status_code == 422  # not a 413
    big = json.dumps({"model": "tiny-dense", "x": "y" * (128 << 10)}).encode()
    for route in ("estimate", "gate", "fit"):
        declared = client.post(f"/api/v1/{route}", content=big, headers=JSON)
        assert declared.status_code == 413, declared.text
        chunks = iter([big[:1000], big[1000:]])
        streamed = client.post(f"/api/v1/{route}", content=chunks, headers=JSON)
        assert streamed.status_code == 413, streamed.text
