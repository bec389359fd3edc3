"""``GET /runs/{id}/logs`` serves a log in bounded pieces (``offset``, ``limit``).

The route read the whole file into memory and answered it whole: a 300 MiB log cost 555 MiB
per request, and reads are public by default. Now one request returns at most
``MAX_LOG_PIECE_BYTES`` from ``offset``, read and sent a chunk at a time; ``X-Log-Size`` and
``X-Next-Offset`` say where the log ends and where the next piece starts. A small log still
comes whole without parameters.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from run_rows import run_row, run_settings, sessions_of

from headroom import planner
from headroom.api.main import create_app
from headroom.api.routes.records import MAX_LOG_PIECE_BYTES
from headroom.api.settings import Settings

#: a log much larger than a piece, written sparse (its middle reads as zeros)
LOG_BYTES = 48 << 20
HEAD = b"step 1 loss 10.5\n"
MIDDLE = b"step 5000 loss 3.25 \xe2\x9c\x93\n"  # a multi-byte character
TAIL = b"step 9999 loss 1.75\ndone\n"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return run_settings(tmp_path).model_copy(update={"launch_runs": False})


def _run_with_log(settings: Settings, uid: str, log: Path | None) -> int:
    with sessions_of(settings)() as session:
        row = run_row(uid, planner.gpu("H100-80GB"), status="succeeded")
        row.log_path = str(log) if log is not None else None
        session.add(row)
        session.commit()
        return row.id


@pytest.fixture
def large_log(settings: Settings) -> Path:
    log = Path(settings.run_dir) / "large" / "log.txt"
    log.parent.mkdir(parents=True)
    with log.open("wb") as f:
        f.write(HEAD)
        f.seek(LOG_BYTES // 2)
        f.write(MIDDLE)
        f.truncate(LOG_BYTES - len(TAIL))
        f.seek(LOG_BYTES - len(TAIL))
        f.write(TAIL)
    assert log.stat().st_size == LOG_BYTES
    return log


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def _piece(client: TestClient, run_id: int, **params: int) -> tuple[bytes, int, int]:
    """(the piece, X-Log-Size, X-Next-Offset) of a 200."""
    response = client.get(f"/api/v1/runs/{run_id}/logs", params=params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    size, next_offset = response.headers["x-log-size"], response.headers["x-next-offset"]
    return response.content, int(size), int(next_offset)


def test_a_large_log_is_served_in_bounded_pieces(
    client: TestClient, settings: Settings, large_log: Path
) -> None:
    run_id = _run_with_log(settings, "large", large_log)
    tracemalloc.start()
    try:
        first, size, next_offset = _piece(client, run_id)
        middle, _, after_middle = _piece(client, run_id, offset=LOG_BYTES // 2, limit=100)
        last, _, end = _piece(client, run_id, offset=LOG_BYTES - 1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (size, len(first), next_offset) == (LOG_BYTES, MAX_LOG_PIECE_BYTES, MAX_LOG_PIECE_BYTES)
    assert first.startswith(HEAD) and first[len(HEAD) :] == bytes(len(first) - len(HEAD))
    assert middle == MIDDLE + bytes(100 - len(MIDDLE))
    assert after_middle == LOG_BYTES // 2 + 100
    assert last.endswith(TAIL) and len(last) == 1000 and end == LOG_BYTES
    # three pieces, the server's chunks and the client's copies: nothing near the 48 MiB log
    assert peak < 8 * MAX_LOG_PIECE_BYTES, f"peak {peak / 2**20:.1f} MiB"


def test_a_log_read_piece_by_piece_comes_back_whole(client: TestClient, settings: Settings) -> None:
    log = Path(settings.run_dir) / "whole" / "log.txt"
    log.parent.mkdir(parents=True)
    written = b"".join(
        b"step %d loss %.3f \xe2\x9c\x93\n" % (i, 1 / (i + 1)) for i in range(150_000)
    )
    log.write_bytes(written)
    run_id = _run_with_log(settings, "whole", log)
    pieces, offset = [], 0
    while True:
        piece, size, next_offset = _piece(client, run_id, offset=offset)
        assert size == len(written) and next_offset == offset + len(piece)
        assert len(piece) <= MAX_LOG_PIECE_BYTES
        if not piece:
            break
        pieces.append(piece)
        offset = next_offset
    assert len(pieces) == -(-len(written) // MAX_LOG_PIECE_BYTES) > 2
    assert b"".join(pieces) == written


def test_a_small_log_comes_whole_without_parameters(client: TestClient, settings: Settings) -> None:
    log = Path(settings.run_dir) / "small" / "log.txt"
    log.parent.mkdir(parents=True)
    log.write_text("the whole log ✓\n")
    run_id = _run_with_log(settings, "small", log)
    response = client.get(f"/api/v1/runs/{run_id}/logs")
    assert (response.status_code, response.text) == (200, "the whole log ✓\n")
    assert response.headers["x-log-size"] == response.headers["x-next-offset"] == "18"


def test_the_end_of_a_log_is_an_empty_piece_and_past_it_a_416(
    client: TestClient, settings: Settings, large_log: Path
) -> None:
    run_id = _run_with_log(settings, "large", large_log)
    at_end, size, next_offset = _piece(client, run_id, offset=LOG_BYTES)
    assert (at_end, size, next_offset) == (b"", LOG_BYTES, LOG_BYTES)
    for offset in (LOG_BYTES + 1, 2**62):
        past = client.get(f"/api/v1/runs/{run_id}/logs", params={"offset": offset})
        assert past.status_code == 416, past.text
        assert past.headers["content-type"] == "application/problem+json"
        assert past.headers["content-range"] == f"bytes */{LOG_BYTES}"
        assert past.json()["field"] == "offset"
        assert past.json()["detail"] == (
            f"offset: {offset} is past the end of the log ({LOG_BYTES} bytes); allowed: 0 to "
            f"{LOG_BYTES}"
        )
    # a run with no log yet: an empty log
    queued = _run_with_log(settings, "queued", None)
    assert _piece(client, queued) == (b"", 0, 0)
    assert client.get(f"/api/v1/runs/{queued}/logs", params={"offset": 1}).status_code == 416


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": MAX_LOG_PIECE_BYTES + 1}, "limit"),
        ({"limit": 0}, "limit"),
        ({"offset": -1}, "offset"),
        ({"offset": "end"}, "offset"),
        ({"offset": 2**62 + 1}, "offset"),
    ],
)
def test_a_range_out_of_bounds_is_a_422_naming_the_parameter(
    client: TestClient, settings: Settings, params: dict[str, object], field: str
) -> None:
    run_id = _run_with_log(settings, "bounds", None)
    response = client.get(f"/api/v1/runs/{run_id}/logs", params=params)
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == [f"query.{field}"]


def test_the_openapi_documents_the_range_and_its_answers(client: TestClient) -> None:
    operation = client.get("/api/v1/openapi.json").json()["paths"]["/api/v1/runs/{run_id}/logs"]
    parameters = {p["name"]: p for p in operation["get"]["parameters"]}
    assert parameters["limit"]["schema"]["maximum"] == MAX_LOG_PIECE_BYTES
    assert parameters["offset"]["schema"]["minimum"] == 0
    answers = operation["get"]["responses"]
    assert set(answers["200"]["headers"]) == {"X-Log-Size", "X-Next-Offset"}
    assert "text/plain" in answers["200"]["content"]
    assert {"404", "410", "416", "422"} <= set(answers)
