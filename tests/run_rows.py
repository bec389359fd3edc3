"""What the run tests share: the service's settings for a test's runs, a run's state through
the API and the wait for its end, a stored run row made by hand (as a stale plan, an orphan or
a queued job would be), the database's sessions, and whether a process (group) is gone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from api_client import wait_for
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.api.settings import Settings
from headroom.store import Run

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: the smallest run the trainer makes: the request body's model and training spec
TINY = {"model": "tiny-dense", "train": {"seq_len": 16, "micro_batch_size": 1}}


def run_settings(tmp_path: Path) -> Settings:
    """A service on SQLite in ``tmp_path`` training on the CPU, two runs at a time."""
    return Settings(
        database_url=f"sqlite:///{tmp_path}/runs.db",
        token=TOKEN,
        run_dir=tmp_path / "runs",
        run_device="cpu",
        max_running=2,
    )


def run_state(client: TestClient, run_id: int) -> dict[str, Any]:
    """The run as ``GET /runs/{id}`` gives it."""
    return client.get(f"/api/v1/runs/{run_id}").json()  # type: ignore[no-any-return]


def run_ended(client: TestClient, run_id: int, timeout: float = 120.0) -> dict[str, Any]:
    """The run once it has ended (succeeded, failed or cancelled), waited for up to
    ``timeout`` seconds."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (
            (r := run_state(client, run_id))["status"] in ("succeeded", "failed", "cancelled") and r
        ),
        timeout=timeout,
        what=f"run {run_id} to end",
    )


def sessions_of(settings: Settings) -> sessionmaker[Session]:
    """Sessions of the settings' database, migrated."""
    store.upgrade(settings.database_url)
    return store.make_sessionmaker(store.make_engine(settings.database_url))


def run_row(
    uid: str,
    hardware: planner.Hardware,
    train: planner.TrainSpec | None = None,
    **values: Any,
) -> Run:
    """A run of ``tiny-dense`` (``train``: micro-batch 4 of 64 tokens) on ``hardware``, two
    steps unless ``values`` say otherwise."""
    model = planner.load_model("tiny-dense")
    train = train or planner.TrainSpec(micro_batch_size=4, seq_len=64)
    plan = {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "hardware": hardware.model_dump(mode="json"),
    }
    return Run(
        uid=uid,
        model_name=model.name,
        gpu_name=hardware.name,
        plan=plan,
        steps=values.pop("steps", 2),
        **values,
    )


def gone(pid: int, group: bool = False) -> bool:
    """Whether process ``pid`` (with ``group``: process group ``pid``) no longer exists."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return True
    return False
