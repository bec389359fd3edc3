"""Two replicas of the service (``headroom serve`` processes) on one PostgreSQL database keep
the run invariants: each run is claimed and trained once, ``MAX_RUNNING`` holds across both
(no two runs' running intervals overlap with ``MAX_RUNNING=1``), and the runs of a replica that
died are reconciled by the other."""

from __future__ import annotations

import itertools
import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
from api_client import wait_for
from headroom_process import Served, serve_headroom
from run_rows import TINY, gone
from sqlalchemy import create_engine, text

TOKEN = "replica-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RUNS = 4
WAIT_S = 180.0


def _env(database_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "HEADROOM_DATABASE_URL": database_url,
        "HEADROOM_TOKEN": TOKEN,
        "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
        "HEADROOM_RUN_DEVICE": "cpu",
        "HEADROOM_MAX_RUNNING": "1",
        "HEADROOM_RECONCILE_EVERY_S": "1",
        "OMP_NUM_THREADS": "1",
    }


def _runs(replica: Served) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = httpx.get(f"{replica.url}/api/v1/runs", timeout=10).json()[
        "items"
    ]
    return items


def _post(replica: Served, body: dict[str, Any]) -> dict[str, Any]:
    created = httpx.post(f"{replica.url}/api/v1/runs", json=body, headers=AUTH, timeout=30)
    assert created.status_code == 201, created.text
    out: dict[str, Any] = created.json()
    return out


def _owner(database_url: str, run_id: int) -> str:
    """The run's owner tag (host:pid:ticks:instance of its supervisor), read from the database
    the replicas share."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            owner = conn.execute(text("SELECT owner FROM runs WHERE id = :id"), {"id": run_id})
            return str(owner.scalar_one())
    finally:
        engine.dispose()


def test_two_replicas_train_each_run_once_and_share_max_running(
    postgres_url: str, tmp_path: Path
) -> None:
    env = _env(postgres_url, tmp_path)
    with (
        serve_headroom(env, tmp_path / "a.log") as a,
        serve_headroom(env, tmp_path / "b.log") as b,
    ):
        posted = [_post((a, b)[i % 2], {**TINY, "steps": 3}) for i in range(RUNS)]
        done = wait_for(
            lambda: (
                len(rs := [r for r in _runs(b) if r["status"] not in ("queued", "running")]) == RUNS
                and rs
            ),
            timeout=WAIT_S,
            what="every run to end",
        )
        logs = {r["id"]: httpx.get(f"{a.url}/api/v1/runs/{r['id']}/logs").text for r in done}
    assert {r["id"] for r in done} == {p["id"] for p in posted}
    assert all(r["status"] == "succeeded" for r in done), [(r["id"], r["reason"]) for r in done]
    # MAX_RUNNING=1 across both replicas: the runs trained one after another
    spans = sorted((r["started_at"], r["finished_at"]) for r in done)
    for (_, finished), (started, _) in itertools.pairwise(spans):
        assert finished <= started, spans
    # each trained once: one trainer's report in each run's log
    for log in logs.values():
        assert log.count('"losses"') == 1, log[-2000:]
        assert len(json.loads(log[log.index("{") :])["losses"]) == 3


def test_a_dead_replicas_run_is_reconciled_by_the_other(postgres_url: str, tmp_path: Path) -> None:
    env = _env(postgres_url, tmp_path)
    with (
        serve_headroom(env, tmp_path / "a.log") as a,
        serve_headroom(env, tmp_path / "b.log") as b,
    ):
        run = _post(a, {**TINY, "steps": 10_000_000})
        running = wait_for(
            lambda: (
                (r := next(x for x in _runs(b) if x["id"] == run["id"]))["pid"] is not None and r
            ),
            timeout=WAIT_S,
            what="the trainer to start",
        )
        tag = _owner(postgres_url, running["id"])
        owners = [r for r in (a, b) if tag.split(":")[1] == str(r.process.pid)]
        assert len(owners) == 1
        owner = owners[0]
        other = b if owner is a else a
        owner.process.send_signal(signal.SIGKILL)  # no shutdown: its trainer is orphaned
        owner.process.wait(timeout=30)
        done = wait_for(
            lambda: (
                (r := next(x for x in _runs(other) if x["id"] == run["id"]))["status"] != "running"
                and r
            ),
            timeout=60,
            what="the other replica to reconcile the run",
        )
        assert done["status"] == "failed" and "trainer was ended" in done["reason"], done
        wait_for(lambda: gone(running["pid"]), timeout=30, what="the orphaned trainer to end")


def test_racing_claims_never_run_more_than_max_running(postgres_url: str) -> None:
    """Eight supervisors claim eight queued runs at once under ``max_running=3`` on PostgreSQL
    (READ COMMITTED: without the claims' advisory lock each would count the running runs
    before any other committed): exactly three are claimed."""
    from headroom import planner, store
    from headroom.launch import RunPlan, queue_run, transitions

    sessions = store.open_store(postgres_url)
    plan = RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec(micro_batch_size=1, seq_len=16),
        planner.gpu("H100-80GB"),
    )
    with sessions() as session:
        ids = [
            queue_run(session=session, plan=plan, steps=2, backend="local", gate=True)[0].id
            for _ in range(8)
        ]
    start = threading.Barrier(len(ids))
    claimed: list[bool] = []

    def claim(i: int, run_id: int) -> None:
        with sessions() as session:
            start.wait()
            ok = transitions.claim(session, run_id, owner=f"s{i}", device="cpu", max_running=3)
            claimed.append(ok)

    threads = [threading.Thread(target=claim, args=(i, r)) for i, r in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(claimed) == [False] * 5 + [True] * 3
