"""8 writers posting calibration records while the server restarts lose nothing, on SQLite
and PostgreSQL.

A real server (uvicorn in a subprocess) takes calibration records from 8 writer threads, each
with its own client-chosen uids. Meanwhile the test stops the server three times, once with
SIGKILL (no shutdown at all, requests cut mid-flight) and twice with SIGTERM (uvicorn's
graceful shutdown), and starts it again on the same port. Writers retry on connection errors,
timeouts and 5xx until the server acknowledges the record (201 created, or 200: already stored
under that uid, when an earlier attempt was committed but its response was lost). In the end
every uid is stored exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import processes
import pytest

TOKEN = "concurrency-token"
WRITERS = 8
PER_WRITER = 25
TOTAL = WRITERS * PER_WRITER
#: stop the server when this many records are acknowledged, with this signal
RESTARTS = [(30, signal.SIGTERM), (90, signal.SIGKILL), (150, signal.SIGTERM)]
DEADLINE_S = 60.0
#: pause between a writer's records: writing takes longer than the restarts in between
PACE_S = 0.08
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``uvicorn api.main:app`` on a fixed port, started and stopped on demand."""

    def __init__(self, database_url: str, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.base = f"http://127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "HEADROOM_DATABASE_URL": database_url,
            "HEADROOM_TOKEN": TOKEN,
            "HEADROOM_MIGRATE": "true",
        }
        self.listen = ["--host", "127.0.0.1", "--port", str(port)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:  # a port just released may still be refused for a moment: try again
            with self.log.open("ab") as log:
                log.write(f"--- start {self.starts + 1}\n".encode())
                log.flush()
                self.proc = processes.popen(
                    [sys.executable, "-m", "uvicorn", "headroom.api.main:app", *self.listen],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if self._wait_ready(deadline):
                self.starts += 1
                return
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise AssertionError(f"the server did not start:\n{self.tail()}")

    def _wait_ready(self, deadline: float) -> bool:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.base}/readyz", timeout=1.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        return False

    def stop(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)  # the server alone: the stop under test
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        processes.stop(self.proc, grace_s=0)  # killed if it is still there, and reaped
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[Server]:
    srv = Server(database_url, _free_port(), tmp_path / "server.log")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(signal.SIGTERM)


class Writer(threading.Thread):
    """Posts its records one by one, each until the server acknowledges it."""

    def __init__(self, index: int, base: str, acknowledged: list[str], lock: threading.Lock):
        super().__init__(name=f"writer-{index}", daemon=True)
        self.index, self.base = index, base
        self.acknowledged, self.lock = acknowledged, lock
        self.outcomes: Counter[str] = Counter()
        self.error: str | None = None

    def body(self, n: int) -> dict[str, Any]:
        return {
            "uid": f"w{self.index}-{n}",
            "model": "tiny-dense",
            "train": {"micro_batch_size": 1 + n % 3},
            "gpu": "H100-80GB",
            "measured": {"allocated_bytes": 123_456_789 + n},
            "source": "probe",
        }

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        deadline = time.monotonic() + DEADLINE_S
        with httpx.Client(base_url=self.base, headers=headers, timeout=5.0) as client:
            for n in range(PER_WRITER):
                body = self.body(n)
                while True:
                    if time.monotonic() > deadline:
                        self.error = f"{body['uid']}: no acknowledgement in {DEADLINE_S} s"
                        return
                    try:
                        response = client.post("/api/v1/calibrations", json=body)
                    except httpx.TransportError as exc:  # refused, reset, timed out
                        self.outcomes[type(exc).__name__] += 1
                        time.sleep(0.02)
                        continue
                    self.outcomes[str(response.status_code)] += 1
                    if response.status_code >= 500:
                        time.sleep(0.02)
                        continue
                    if response.status_code not in (200, 201):
                        self.error = f"{body['uid']}: {response.status_code} {response.text}"
                        return
                    stored = response.json()
                    if stored["uid"] != body["uid"]:
                        self.error = f"{body['uid']}: acknowledged as {stored['uid']}"
                        return
                    with self.lock:
                        self.acknowledged.append(body["uid"])
                    break
                time.sleep(PACE_S)  # spread the records over the restarts


def _all_records(base: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    with httpx.Client(base_url=base, timeout=10.0) as client:
        while True:
            page = client.get("/api/v1/calibrations", params={"limit": 500, "offset": len(items)})
            assert page.status_code == 200, page.text
            data = page.json()
            items += data["items"]
            if not data["items"] or len(items) >= data["total"]:
                assert len(items) == data["total"], (len(items), data["total"])
                return items


def test_writers_lose_nothing_while_the_server_restarts(server: Server) -> None:
    acknowledged: list[str] = []
    lock = threading.Lock()
    writers = [Writer(i, server.base, acknowledged, lock) for i in range(WRITERS)]
    for w in writers:
        w.start()

    restarts: list[tuple[int, str]] = []
    for threshold, sig in RESTARTS:
        while len(acknowledged) < threshold and any(w.is_alive() for w in writers):
            time.sleep(0.002)
        before = list(acknowledged)
        server.stop(sig)
        restarts.append((len(before), sig.name))
        server.start()
        # nothing acknowledged before the stop was lost with it (SIGKILL included)
        stored = {row["uid"] for row in _all_records(server.base)}
        assert set(before) <= stored, (sig.name, sorted(set(before) - stored))

    for w in writers:
        w.join(timeout=DEADLINE_S + 10)
    errors = [w.error for w in writers if w.error] + [w.name for w in writers if w.is_alive()]
    outcomes = sum((w.outcomes for w in writers), Counter())
    context = f"restarts {restarts}, outcomes {dict(outcomes)}\nserver log:\n{server.tail()}"
    print(f"restarts at {restarts}; writers saw {dict(outcomes)}")
    assert not errors, f"{errors}\n{context}"

    # every restart happened while writers were still writing
    assert server.starts == 1 + len(RESTARTS), context
    assert all(0 < done < TOTAL for done, _ in restarts), context
    assert any(k not in ("200", "201") for k in outcomes), context  # the writers saw the outages

    expected = {f"w{i}-{n}" for i in range(WRITERS) for n in range(PER_WRITER)}
    assert sorted(acknowledged) == sorted(expected), context
    records = _all_records(server.base)
    uids = Counter(row["uid"] for row in records)
    assert set(uids) == expected, context
    assert all(count == 1 for count in uids.values()), [u for u, c in uids.items() if c > 1]
    assert len(records) == TOTAL
    by_uid = {row["uid"]: row for row in records}
    assert by_uid["w3-17"]["measured_peak_bytes"] == 123_456_789 + 17
