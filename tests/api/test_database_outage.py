"""The database goes away and comes back while the service runs trainers.

A TCP proxy (``tests/tcp_proxy.py``) stands between the service and PostgreSQL; stopping it
closes every connection and refuses new ones, as a database that went down would. Meanwhile
every database route answers 503 problem+json with ``Retry-After`` (it was a 500), the
supervisor logs one line when the outage starts and one when it ends (it was a traceback a
tick), and the trainers that end meanwhile are recorded with their true endings once the
database is back: a run used to stay ``running`` for good, because the supervisor dropped the
trainer before its failing write. Nothing acknowledged is lost, and a write refused with 503
can be retried with its ``uid``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import processes
import pytest
from api_client import wait_for
from fastapi.testclient import TestClient
from headroom_process import serve_headroom
from sqlalchemy.engine import make_url
from tcp_proxy import TcpProxy

from headroom import planner, store
from headroom.api.main import create_app
from headroom.api.settings import Settings
from headroom.launch import Supervisor
from headroom.store import Run

TOKEN = "outage-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = {"model": "tiny-dense", "train": {"seq_len": 16, "micro_batch_size": 1}}
RECORD = {
    "model": "tiny-dense",
    "train": {"micro_batch_size": 2, "seq_len": 512},
    "gpu": "H100-80GB",
    "measured": {"allocated_bytes": 150_000_000, "reserved_bytes": 170_000_000},
    "source": "runtime",
}
ENDED = ("succeeded", "failed", "cancelled")


def process_state(pid: int) -> str:
    """The process's state letter (``Z``: exited, not reaped), or '' once it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[TcpProxy]:
    url = make_url(postgres_url)
    with TcpProxy((url.host or "127.0.0.1", url.port or 5432)) as p:
        yield p


def through(proxy: TcpProxy, postgres_url: str) -> str:
    """``postgres_url`` by way of the proxy."""
    url = make_url(postgres_url).set(host="127.0.0.1", port=proxy.port)
    return url.render_as_string(hide_password=False)


def settings_for(database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        database_url=database_url,
        token=TOKEN,
        run_dir=tmp_path / "runs",
        run_device="cpu",
        max_running=3,
    )


def small_card_run(uid: str) -> Run:
    """A queued run whose planned card is far too small: its trainer runs out of memory on the
    simulated device (stored past the gate, as a stale plan would be)."""
    model = planner.load_model("tiny-dense")
    train = planner.TrainSpec(micro_batch_size=4, seq_len=64)
    small = planner.Hardware(
        **{**planner.gpu("RTX-3090").model_dump(), "name": "sim-1MiB", "aliases": ()},
    ).model_copy(update={"memory_bytes": 2**20, "cuda_context_bytes": 0})
    plan = {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "hardware": small.model_dump(mode="json"),
    }
    return Run(
        uid=uid, status="queued", model_name=model.name, gpu_name=small.name, plan=plan, steps=2
    )


def assert_unavailable(response: httpx.Response) -> None:
    request = f"{response.request.method} {response.request.url.path}"
    assert response.status_code == 503, (request, response.status_code, response.text)
    assert response.headers["content-type"] == "application/problem+json", request
    assert int(response.headers["retry-after"]) > 0, request
    problem = response.json()
    assert problem["status"] == 503 and "database" in problem["detail"], (request, problem)


def test_runs_end_with_their_true_reason_and_routes_answer_503_through_an_outage(
    proxy: TcpProxy, postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="headroom.runs")
    settings = settings_for(through(proxy, postgres_url), tmp_path)
    direct = store.make_sessionmaker(store.make_engine(postgres_url))
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        # acknowledged before the outage: a calibration and three runs
        record = client.post("/api/v1/calibrations", json={**RECORD, "uid": "rec"}, headers=AUTH)
        assert record.status_code == 201, record.text
        runs = {
            "ok": client.post("/api/v1/runs", json={**TINY, "steps": 2}, headers=AUTH),
            "killed": client.post("/api/v1/runs", json={**TINY, "steps": 10**7}, headers=AUTH),
        }
        assert all(r.status_code == 201 for r in runs.values()), runs
        ids = {name: r.json()["id"] for name, r in runs.items()}
        with direct() as session:
            session.add(small_card_run("oom"))
            session.commit()
            ids["oom"] = session.query(Run).filter_by(uid="oom").one().id

        def started() -> dict[str, int] | None:
            pids = {name: client.get(f"/api/v1/runs/{i}").json()["pid"] for name, i in ids.items()}
            return pids if all(pids.values()) else None

        pids = wait_for(started, what="the three trainers to start")
        for pid in pids.values():  # hold them until the database is gone
            os.killpg(pid, signal.SIGSTOP)
        for name, pid in pids.items():  # each is still starting: it has to end in the outage
            state = wait_for(
                lambda pid=pid: (s := process_state(pid)) not in ("R", "S", "D") and (s or "gone"),
                what=f"the {name} trainer to stop",
            )
            assert state == "T", (name, state)
        caplog.clear()

        proxy.stop()
        os.killpg(pids["killed"], signal.SIGKILL)
        for name in ("ok", "oom"):
            os.killpg(pids[name], signal.SIGCONT)

        # every database route answers 503 with Retry-After; the rest still answer
        run_id, missing = ids["killed"], 2**31 - 1
        for method, path, body in [
            ("get", "/api/v1/runs", None),
            ("post", "/api/v1/runs", {**TINY, "uid": "in-the-outage"}),
            ("get", f"/api/v1/runs/{run_id}", None),
            ("get", f"/api/v1/runs/{missing}", None),
            ("get", f"/api/v1/runs/{run_id}/logs", None),
            ("post", f"/api/v1/runs/{run_id}/cancel", None),
            ("get", "/api/v1/calibrations", None),
            ("post", "/api/v1/calibrations", {**RECORD, "uid": "rec-in-the-outage"}),
            ("get", "/api/v1/calibrations/1", None),
            ("get", "/api/v1/coefficients", None),
        ]:
            assert_unavailable(client.request(method, path, json=body, headers=AUTH))
        ready = client.get("/api/v1/readyz")
        assert ready.status_code == 503 and ready.headers["Retry-After"].isdigit()
        assert client.get("/api/v1/healthz").status_code == 200
        assert client.post("/api/v1/estimate", json=TINY).status_code == 200

        # the trainers end while the database is away (the supervisor reaps them)
        for name, pid in pids.items():
            wait_for(lambda pid=pid: process_state(pid) == "", what=f"the {name} trainer to end")
        time.sleep(1)  # a few supervisor ticks against the missing database

        proxy.start()
        final = {
            name: wait_for(
                lambda i=i: (
                    (r := client.get(f"/api/v1/runs/{i}")).status_code == 200
                    and r.json()["status"] in ENDED
                    and r.json()
                ),
                timeout=30,
                what=f"the {name} run to end once the database is back",
            )
            for name, i in ids.items()
        }
        assert (final["ok"]["status"], final["ok"]["exit_code"]) == ("succeeded", 0), final["ok"]
        assert final["ok"]["reason"] == "completed 2 step(s)", final["ok"]
        assert (final["killed"]["status"], final["killed"]["exit_code"]) == ("failed", -9)
        assert final["killed"]["reason"] == "killed by SIGKILL", final["killed"]
        assert (final["oom"]["status"], final["oom"]["exit_code"]) == ("failed", 3), final["oom"]
        assert final["oom"]["reason"].startswith("out of memory in "), final["oom"]

        # nothing acknowledged was lost; what was refused is stored when retried with its uid
        assert client.get("/api/v1/calibrations/{}".format(record.json()["id"])).status_code == 200
        retried = client.post(
            "/api/v1/calibrations", json={**RECORD, "uid": "rec-in-the-outage"}, headers=AUTH
        )
        assert retried.status_code == 201, retried.text
        queued = client.post("/api/v1/runs", json={**TINY, "uid": "in-the-outage"}, headers=AUTH)
        assert queued.status_code == 201, queued.text
        listed = client.get("/api/v1/runs").json()
        assert sorted(r["id"] for r in listed["items"]) == sorted(
            [*ids.values(), queued.json()["id"]]
        )

    # one line when the outage began and one when it ended, no traceback
    lines = [r for r in caplog.records if r.name == "headroom.runs"]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.INFO], [
        r.getMessage() for r in lines
    ]
    assert all(r.exc_info is None for r in lines)
    assert "database" in lines[0].getMessage() and "database" in lines[1].getMessage()


def test_an_ending_seen_in_an_outage_survives_the_service_stopping(
    proxy: TcpProxy, postgres_url: str, tmp_path: Path
) -> None:
    """The service sees its trainer killed while the database is away, then stops before the
    database returns: the next supervisor records the true ending, not "exit status lost"."""
    settings = settings_for(through(proxy, postgres_url), tmp_path)
    store.upgrade(postgres_url)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HEADROOM_DATABASE_URL": settings.database_url,
        "HEADROOM_TOKEN": TOKEN,
        "HEADROOM_RUN_DIR": str(settings.run_dir),
        "HEADROOM_RUN_DEVICE": "cpu",
    }
    port = free_port()
    service = processes.popen(
        [sys.executable, "-m", "headroom", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}/api/v1"
        wait_for(lambda: _answers(f"{base}/readyz"), what="the service to start")
        run = httpx.post(f"{base}/runs", json={**TINY, "steps": 10**7}, headers=AUTH).json()
        pid = wait_for(
            lambda: httpx.get(f"{base}/runs/{run['id']}").json()["pid"], what="the trainer"
        )
        proxy.stop()
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: process_state(pid) == "", what="the supervisor to reap the trainer")
        service.send_signal(signal.SIGTERM)
        _, stderr = service.communicate(timeout=30)
    finally:
        processes.stop(service, grace_s=0)  # killed if still there, with what it started
    assert "Traceback" not in stderr, stderr

    proxy.start()
    sessions = store.make_sessionmaker(store.make_engine(postgres_url))
    assert Supervisor(sessions, settings).reconcile() == 1
    with sessions() as session:
        row = session.get(Run, run["id"])
        assert row is not None
        assert (row.status, row.reason, row.exit_code) == ("failed", "killed by SIGKILL", -9)


def test_headroom_serve_logs_an_outage_once_when_it_begins_and_once_when_it_ends(
    proxy: TcpProxy, postgres_url: str, tmp_path: Path
) -> None:
    """Under ``headroom serve``, with its one place taken by a trainer (a tick then asks the
    database nothing) and many requests answered 503 meanwhile: one warning when the database
    goes, one INFO line when it is back, each naming the supervisor's logger. A tick that asked
    nothing used to count as the database reached: the outage "ended" and began again at every
    reconciliation (75 warnings in 20 s), and uvicorn's logging dropped the INFO lines."""
    log = tmp_path / "serve.log"
    env = {
        "OMP_NUM_THREADS": "1",
        "HEADROOM_DATABASE_URL": through(proxy, postgres_url),
        "HEADROOM_TOKEN": TOKEN,
        "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
        "HEADROOM_RUN_DEVICE": "cpu",
        "HEADROOM_MAX_RUNNING": "1",
        "HEADROOM_RECONCILE_EVERY_S": "0.5",  # the supervisor asks the database twice a second
    }
    with serve_headroom(env, log) as served:
        base = f"{served.url}/api/v1"
        run = httpx.post(f"{base}/runs", json={**TINY, "steps": 10**7}, headers=AUTH).json()
        pid = wait_for(
            lambda: httpx.get(f"{base}/runs/{run['id']}").json()["pid"], what="the trainer"
        )
        os.killpg(pid, signal.SIGSTOP)  # it keeps the place, not the CPU
        try:
            proxy.stop()
            answered: Counter[int] = Counter()
            paths = ["/runs", f"/runs/{run['id']}", "/calibrations", "/coefficients", "/readyz"]

            def requests(rounds: int) -> None:
                for _ in range(rounds):
                    for path in paths:
                        answered[httpx.get(base + path, timeout=10).status_code] += 1

            def noticed() -> bool:
                requests(1)
                return "database unreachable" in log.read_text()

            wait_for(noticed, what="the supervisor to notice the outage")
            requests(10)  # seconds of them: many reconciliations more
            assert set(answered) == {503} and answered[503] >= 50, answered
            proxy.start()
            wait_for(
                lambda: "database reachable again" in log.read_text(),
                what="the supervisor to notice the database is back",
            )
            assert httpx.get(f"{base}/runs/{run['id']}").status_code == 200
            time.sleep(1)  # ticks and reconciliations on the database that is back
        finally:
            os.killpg(pid, signal.SIGCONT)
    lines = log.read_text().splitlines()
    gone = [line for line in lines if "database unreachable" in line]
    back = [line for line in lines if "database reachable again" in line]
    assert len(gone) == 1 and len(back) == 1, "\n".join(lines)
    assert gone[0].startswith("WARNING:") and " headroom.runs: " in gone[0], gone
    assert back[0].startswith("INFO:") and " headroom.runs: " in back[0], back
    assert not any("Traceback" in line for line in lines), "\n".join(lines)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A local port free now (bound, then released for the service to take)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_sqlite_database_that_cannot_be_opened_is_503(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'h.db'}",
        token=TOKEN,
        migrate=False,
        launch_runs=False,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert_unavailable(client.get("/api/v1/runs"))
        assert_unavailable(client.post("/api/v1/calibrations", json=RECORD, headers=AUTH))
