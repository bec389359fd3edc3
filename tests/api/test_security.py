"""The bearer token is checked before a write's body is read.

FastAPI reads and parses a request's body before it solves the route's dependencies: a write
with a wrong token and a 1 MiB body cost 68 ms of server CPU for its 401, and four such
clients cut a preset ``/estimate`` from 1,796 to 35 req/s. The body here is streamed to the
app in process, counting what the app takes of it: a refused request takes nothing, whether
its length is declared or not, and the right token still gets its body read and stored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from headroom import store
from headroom.api import Settings, create_app

TOKEN = "first-token"
RECORD = {
    "model": "tiny-dense",
    "train": {"micro_batch_size": 2, "seq_len": 512},
    "gpu": "H100-80GB",
    "measured": {"allocated_bytes": 150_000_000, "reserved_bytes": 170_000_000},
    "source": "runtime",
}
#: a body close to MAX_BODY_BYTES (1 MiB): the record, padded with whitespace after it
PAYLOAD = json.dumps(RECORD).encode() + b" " * 900_000
CHUNK = 16 * 1024


class StreamedBody:
    """A request body handed to the app chunk by chunk, counting the bytes it took."""

    def __init__(self, payload: bytes) -> None:
        self.payload, self.taken = payload, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self.payload), CHUNK):
            piece = self.payload[start : start + CHUNK]
            self.taken += len(piece)
            yield piece


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    url = f"sqlite:///{tmp_path / 'token.db'}"
    store.upgrade(url)
    return create_app(
        Settings(
            database_url=url,
            token=TOKEN,
            launch_runs=False,
            migrate=False,
            run_dir=tmp_path / "runs",
        )
    )


def _post(app: FastAPI, path: str, body: StreamedBody, headers: dict[str, str]) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(
                path, content=body, headers={"Content-Type": "application/json", **headers}
            )

    return asyncio.run(post())


#: Authorization headers that do not carry the token
REFUSED = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer"},
]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/api/v1/calibrations", "/api/v1/runs", "/api/v1/runs/1/cancel"])
def test_a_write_without_the_token_is_refused_before_its_body_is_read(
    app: FastAPI, path: str, declared: bool
) -> None:
    for headers in REFUSED:
        body = StreamedBody(PAYLOAD)
        length = {"Content-Length": str(len(PAYLOAD))} if declared else {}
        response = _post(app, path, body, {**headers, **length})
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "token" in response.json()["detail"]
        assert body.taken == 0, f"{path} read {body.taken} bytes of a refused body ({headers})"


def test_the_right_token_still_gets_its_body_read_and_stored(app: FastAPI) -> None:
    for declared in (True, False):
        body = StreamedBody(PAYLOAD)
        length = {"Content-Length": str(len(PAYLOAD))} if declared else {}
        response = _post(
            app, "/api/v1/calibrations", body, {"Authorization": f"Bearer {TOKEN}", **length}
        )
        assert response.status_code == 201, response.text
        assert response.json()["model_name"] == "tiny-dense"
        assert body.taken == len(PAYLOAD)


def test_a_server_without_a_token_refuses_writes_before_their_body(tmp_path: Path) -> None:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'none.db'}", launch_runs=False))
    body = StreamedBody(PAYLOAD)
    response = _post(app, "/api/v1/runs", body, {"Authorization": "Bearer anything"})
    assert response.status_code == 401
    assert response.json()["detail"] == (
        "this endpoint needs HEADROOM_TOKEN to be configured on the server"
    )
    assert body.taken == 0
