"""The service's planning routes with specs at (or past) the planner's bounds: a valid plan or a
422 naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

from headroom import planner

TOKEN = "bounds-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("bounds") / "b.db"
    with service_client(f"sqlite:///{db}", TOKEN) as c:
        yield c


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(f"/api/v1/{path}", json=body, headers=AUTH)


def test_fit_with_the_largest_accumulation_is_a_valid_plan(client: TestClient) -> None:
    train = {"micro_batch_size": 2, "grad_accum_steps": 2**30}
    response = post(client, "fit", {"model": "llama-3-8b", "gpu": "H100-80GB", "train": train})
    assert response.status_code == 200, response.text
    plan = planner.TrainSpec.model_validate(response.json()["plan"])
    assert plan.micro_batch_size * plan.grad_accum_steps == 2**31


def test_a_run_with_the_largest_accumulation_is_queued_with_a_valid_plan(
    client: TestClient,
) -> None:
    train = {"micro_batch_size": 2, "grad_accum_steps": 2**30}
    body = {"model": "llama-3-8b", "gpu": "H100-80GB", "train": train, "fit": True}
    response = post(client, "runs", body)
    assert response.status_code < 300, response.text
    plan = planner.TrainSpec.model_validate(response.json()["plan"]["train"])
    assert plan.micro_batch_size * plan.grad_accum_steps == 2**31


def assert_422(response: Any, field: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem: dict[str, Any] = response.json()
    named = {problem.get("field")} | {e["field"] for e in problem.get("errors", [])}
    assert any(n == field or (n or "").startswith(f"{field}.") for n in named), problem
    return problem


@pytest.mark.parametrize(
    ("parallel", "field"),
    [
        ({"tp": 3}, "train.parallel.tp"),
        ({"tp": 64}, "train.parallel.tp"),
        ({"pp": 64}, "train.parallel.pp"),
        ({"dp": 3, "ep": 3}, "train.parallel.ep"),
    ],
)
@pytest.mark.parametrize("path", ["estimate", "gate", "fit"])
def test_impossible_layouts_are_422(
    client: TestClient, path: str, parallel: dict[str, Any], field: str
) -> None:
    model = "mixtral-8x7b" if "ep" in parallel else "llama-3-8b"  # 32 heads, 8 KV, 32 layers
    body = {"model": model, "train": {"parallel": parallel}}
    assert_422(post(client, path, body), field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "tiny-dense", "host_memory": True}, "host_memory"),
        ({"model": "tiny-dense", "gpus_per_node": True}, "gpus_per_node"),
        ({"model": "tiny-dense", "train": {"micro_batch_size": True}}, "train.micro_batch_size"),
        (
            {
                "model": {
                    "name": "b",
                    "vocab_size": 1000,
                    "hidden_size": 64,
                    "num_layers": True,
                    "num_heads": 4,
                    "ffn_hidden_size": 128,
                }
            },
            "model.num_layers",
        ),
        (
            {
                "model": {
                    "model_type": "llama",
                    "vocab_size": 1000,
                    "hidden_size": 64,
                    "num_hidden_layers": True,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                }
            },
            "num_hidden_layers",
        ),
    ],
    ids=["host-memory", "gpus-per-node", "micro-batch", "num-layers", "hf-num-hidden-layers"],
)
def test_booleans_are_not_numbers(client: TestClient, body: dict[str, Any], field: str) -> None:
    assert_422(post(client, "estimate", body), field)
