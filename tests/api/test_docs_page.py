"""The API's docs page loads Swagger UI from this server (the pinned package's files), nothing
from a CDN, and says so in its Content-Security-Policy."""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import resources

import pytest
from api_client import service_client
from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("docs") / "d.db"
    with service_client(f"sqlite:///{db}", "docs-token") as c:
        yield c


def test_the_docs_page_loads_only_from_this_server(client: TestClient) -> None:
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*["']([^"']+)["']""", response.text)
    assert sorted(urls) == [
        "/api/v1/docs/assets/favicon.png",
        "/api/v1/docs/assets/swagger-ui-bundle.js",
        "/api/v1/docs/assets/swagger-ui.css",
        "/api/v1/openapi.json",
    ]
    assert "cdn" not in response.text.lower()
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "http" not in policy


@pytest.mark.parametrize("name", ["swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"])
def test_the_assets_are_the_pinned_packages(client: TestClient, name: str) -> None:
    response = client.get(f"/api/v1/docs/assets/{name}")
    assert response.status_code == 200
    shipped = (resources.files("fastapi_offline") / "static" / name).read_bytes()
    assert response.content == shipped


def test_the_bundle_is_swagger_ui_5(client: TestClient) -> None:
    # Swagger UI renders OpenAPI 3.1 (what FastAPI writes) from version 5 on
    bundle = client.get("/api/v1/docs/assets/swagger-ui-bundle.js").text
    match = re.search(r'PACKAGE_VERSION:"(\d+)\.\d+\.\d+"', bundle)
    assert match and int(match.group(1)) >= 5, "not Swagger UI 5"
    assert client.get("/api/v1/openapi.json").json()["openapi"].startswith("3.1")


@pytest.mark.parametrize("name", ["redoc.standalone.js", "..%2F__init__.py", "x.js"])
def test_no_other_file_is_served(client: TestClient, name: str) -> None:
    assert client.get(f"/api/v1/docs/assets/{name}").status_code == 404
