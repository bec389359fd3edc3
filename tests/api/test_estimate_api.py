"""The service's first slice: estimate and presets over HTTP, errors as problem+json."""

from __future__ import annotations

from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app

client = TestClient(create_app())


def test_estimate_matches_planner() -> None:
    body = {
        "model": "llama-3-8b",
        "train": {"micro_batch_size": 2},
        "gpu": "H200-141GB",
        "host_memory": "1TiB",
    }
    response = client.post("/api/v1/estimate", json=body)
    assert response.status_code == 200
    hw = planner.gpu("H200-141GB").model_copy(update={"host_memory_bytes": 2**40})
    expected = planner.estimate(
        planner.load_model("llama-3-8b"), planner.TrainSpec(micro_batch_size=2), hw
    )
    assert response.json() == expected.model_dump()


def test_predicted_oom_is_200_with_verdict() -> None:
    response = client.post("/api/v1/estimate", json={"model": "llama-3-70b", "gpu": "RTX-4090"})
    assert response.status_code == 200
    assert response.json()["fits"] is False


def test_bad_input_is_422_problem_json() -> None:
    response = client.post(
        "/api/v1/estimate", json={"model": "llama-3-8b", "train": {"seq_len": -1}}
    )
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "train.seq_len" in response.json()["detail"]
    response = client.post("/api/v1/estimate", json={"model": "llama-3-8b", "gpu": "Z1"})
    assert response.status_code == 422 and "allowed:" in response.json()["detail"]
    response = client.post(
        "/api/v1/estimate", content=b"{", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422


def test_presets_and_health() -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    names = {g["name"] for g in client.get("/api/v1/presets").json()["gpus"]}
    assert "H100-80GB" in names
    assert client.get("/api/v1/openapi.json").status_code == 200
