"""The /plan and /fit searches' queue: bounded, with the searches of clients that have gone
dropped, and each search time-boxed.

After 20 dropped ``/plan`` requests a 10 ms ``/fit`` waited 60 s: the queue had no bound, and
every search was computed whether or not its client was still there. Now at most
``search_queue`` searches wait (503 with Retry-After past them), a queued search whose client
has gone is never started, a running one stops when its client goes, and a search stops at
``search_deadline_s`` (503 with Retry-After).

Disconnection is real: ``headroom serve`` in a process of its own, clients on raw sockets that
send a request and close. ``/metrics`` counts each search's outcome.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from api_client import service_client, wait_for
from fastapi.testclient import TestClient
from headroom_process import Served, serve_headroom

from headroom.api import Settings, create_app

#: the longest plan the service makes of a bundled model: 0.6-1.4 s of CPU on an idle 2-core VM
LONG_PLAN = {
    "model": "gpt3-175b",
    "cluster": "DGX-A100",
    "gpus": 1024,
    "global_batch": 1536,
    "seq_len": 2048,
}
SHORT_FIT = {"model": "tiny-dense", "gpu": "H100-80GB"}


@contextmanager
def served(tmp_path: Path, **settings: object) -> Iterator[Served]:
    env = {
        "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'headroom.db'}",
        "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
        "HEADROOM_LAUNCH_RUNS": "false",
        **{f"HEADROOM_{name.upper()}": str(value) for name, value in settings.items()},
    }
    with serve_headroom(env, tmp_path / "serve.log") as server:
        yield server


def send(server: Served, path: str, body: dict[str, Any]) -> socket.socket:
    """A connection that has sent ``POST path`` with ``body`` (and asked to be closed after)."""
    raw = json.dumps(body).encode()
    head = (
        f"POST /api/v1/{path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(head.encode() + raw)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body a connection got, read to its close."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    return int(status_line.split()[1]), headers, body


def metrics(server: Served) -> dict[str, float]:
    """The searches' samples of ``/metrics``: outcome counts by ``endpoint/outcome``, and
    ``waiting`` and ``running``."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for endpoint, outcome, value in re.findall(
        r'^headroom_searches_total\{endpoint="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.M
    ):
        found[f"{endpoint}/{outcome}"] = float(value)
    for gauge in ("waiting", "running"):
        match = re.search(rf"^headroom_searches_{gauge} (\S+)$", text, re.M)
        assert match is not None, text
        found[gauge] = float(match[1])
    return found


def test_a_full_queue_is_503_with_retry_after(tmp_path: Path) -> None:
    with served(tmp_path, search_queue=1, search_deadline_s=60) as server:
        # at once: one runs, one waits, the rest find the queue full
        socks = [send(server, "plan", LONG_PLAN) for _ in range(4)]
        answers = [answer(sock) for sock in socks]
        statuses = Counter(status for status, _, _ in answers)
        assert statuses == {200: 2, 503: 2}, answers
        for status, headers, body in answers:
            if status == 503:
                assert headers["content-type"] == "application/problem+json", headers
                assert headers["retry-after"] == "60"
                problem = json.loads(body)
                assert problem["status"] == 503 and "search_queue" in problem["detail"]
        counts = metrics(server)
        assert counts["plan/queue_full"] == 2 and counts["plan/done"] == 2, counts
        # the queue empties: searches are served again
        status, _, _ = answer(send(server, "fit", SHORT_FIT))
        assert status == 200


def test_a_queued_search_whose_client_left_is_never_started(tmp_path: Path) -> None:
    with served(tmp_path, search_deadline_s=60) as server:
        running = send(server, "plan", LONG_PLAN)
        wait_for(lambda: metrics(server)["running"] == 1, 30, "the first search to start")
        left = [send(server, "plan", LONG_PLAN) for _ in range(3)]
        wait_for(lambda: metrics(server)["waiting"] == 3, 30, "three searches queued")
        for sock in left:
            sock.close()
        status, _, _ = answer(running)
        assert status == 200
        counts = wait_for(
            lambda: (c := metrics(server)).get("plan/client_gone") == 3 and c,
            30,
            "the queued searches to be dropped",
        )
        # one search started (and was done); the three others never did
        started = {k: v for k, v in counts.items() if k.startswith("plan/")}
        assert started == {"plan/done": 1, "plan/client_gone": 3}, counts
        assert counts["waiting"] == 0 and counts["running"] == 0
        status, _, _ = answer(send(server, "fit", SHORT_FIT))
        assert status == 200


def test_a_running_search_whose_client_left_stops(tmp_path: Path) -> None:
    with served(tmp_path, search_deadline_s=60) as server:
        sock = send(server, "plan", LONG_PLAN)
        wait_for(lambda: metrics(server)["running"] == 1, 30, "the search to start")
        sock.close()
        counts = wait_for(
            lambda: (c := metrics(server)).get("plan/cancelled") == 1 and c,
            30,
            "the search to stop",
        )
        assert "plan/done" not in counts and counts["running"] == 0, counts
        status, _, _ = answer(send(server, "fit", SHORT_FIT))
        assert status == 200


DEEP_FIT = {"model": "deepseek-v3"}


@pytest.mark.timing  # a wall-clock bound: on two busy cores the longest plan took over 5 s
def test_the_default_deadline_answers_the_longest_searches(tmp_path: Path) -> None:
    assert Settings().search_deadline_s == 5.0
    with service_client(f"sqlite:///{tmp_path / 'a.db'}", "t") as client:
        assert client.post("/api/v1/plan", json=LONG_PLAN).status_code == 200
        assert client.post("/api/v1/fit", json=DEEP_FIT).status_code == 200


def test_a_search_past_its_deadline_stops_with_a_503(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'b.db'}", launch_runs=False, search_deadline_s=0.001
    )
    app = create_app(settings)
    with TestClient(app) as client:
        for path, body in (("plan", LONG_PLAN), ("fit", DEEP_FIT)):
            response = client.post(f"/api/v1/{path}", json=body)
            assert response.status_code == 503, response.text[:300]
            assert response.headers["content-type"] == "application/problem+json"
            assert response.headers["retry-after"] == "1"
            assert "deadline of 0.001 s (search_deadline_s)" in response.json()["detail"]
        text = client.get("/metrics").text
        assert 'headroom_searches_total{endpoint="plan",outcome="deadline"} 1.0' in text
        assert 'headroom_searches_total{endpoint="fit",outcome="deadline"} 1.0' in text
    app.state.engine.dispose()
