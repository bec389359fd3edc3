"""The service's planning routes with specs at (or past) the planner's bounds: a valid plan or a
422 naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app
from headroom.api.settings import Settings

TOKEN = "bounds-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("bounds") / "b.db"
    app = create_app(Settings(database_url=f"sqlite:///{db}", token=TOKEN, launch_runs=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(f"/api/v1/{path}", json=body, headers=AUTH)


def test_fit_with_the_largest_accumulation_is_a_valid_plan(client: TestClient) -> None:
    train = {"micro_batch_size": 2, "grad_accum_steps": 2**30}
    response = post(client, "fit", {"model": "llama-3-8b", "gpu": "H100-80GB", "train": train})
    assert response.status_code == 200, response.text
    plan = planner.TrainSpec.model_validate(response.json()["plan"])
    assert plan.micro_batch_size * plan.grad_accum_steps == 2**31
