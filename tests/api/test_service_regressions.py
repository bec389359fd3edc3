"""Regressions for what fuzzing the service found: each input used to end in a 5xx, a hang or a
response the OpenAPI did not describe; now it is a 422 problem+json naming the field.

Found by tests/api/test_fuzz_openapi.py (schemathesis, and planner-aware bodies), by a direct
fuzz of the planner's loaders, or while checking those findings on PostgreSQL.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient

from headroom import planner

TOKEN = "regression-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
DENSE = {
    "name": "r",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_hidden_size": 128,
}
MOE = {**DENSE, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 32}}
GPU = {
    "name": "g",
    "memory_bytes": 80 * 2**30,
    "bf16_flops": 9.9e14,
    "memory_bandwidth_bytes_per_s": 3.35e12,
    "host_link": "PCIe Gen5 x16",
    "host_link_bytes_per_s": 6.4e10,
    "cuda_context_bytes": 500 * 2**20,
    "allocator_overhead_fraction": 0.05,
}
QWEN_MOE = {
    "model_type": "qwen2_moe",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("regressions") / "r.db"
    with service_client(f"sqlite:///{db}", TOKEN) as c:
        yield c


def post(client: TestClient, path: str, body: Any) -> Any:
    """POST ``body`` (a dict, written with NaN/Infinity as Python's json does, or raw bytes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(f"/api/v1/{path}", content=content, headers=AUTH)


def assert_422(response: Any, field: str, detail: str | None = None) -> dict[str, Any]:
    """A 422 problem+json whose ``field`` (or one of its ``errors``) names ``field``, and whose
    detail says ``detail`` (default: the field)."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem: dict[str, Any] = response.json()
    named = {problem.get("field")} | {e["field"] for e in problem.get("errors", [])}
    assert any(n == field or (n or "").startswith(f"{field}.") for n in named), problem
    assert (detail or field) in problem["detail"], problem
    return problem


# --- request bodies FastAPI could not decode were an undocumented 400 ------------------------


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "tiny-dense", "notes": "\xff\xfe"}',  # not UTF-8
        b'{"model": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # deeper than the JSON parser goes
        b'{"model": "tiny-dense", "train": {"seq_len": 1' + b"0" * 5000 + b"}}",  # > 4300 digits
    ],
    ids=["not-utf8", "nested-3000", "5000-digits"],
)
def test_undecodable_body_is_422_naming_the_body(client: TestClient, content: bytes) -> None:
    for path in ("estimate", "calibrations"):
        assert_422(post(client, path, content), "body")


# --- every 422 was documented as application/json HTTPValidationError ------------------------


def test_openapi_documents_422_as_problem_json(client: TestClient) -> None:
    paths = client.get("/api/v1/openapi.json").json()["paths"]
    documented = 0
    for operations in paths.values():
        for operation in operations.values():
            response = operation["responses"].get("422")
            if response is not None:
                documented += 1
                assert list(response["content"]) == ["application/problem+json"]
                schema = response["content"]["application/problem+json"]["schema"]
                assert {"type", "title", "status", "detail"} <= set(schema["required"])
                assert "errors" in schema["properties"]
    assert documented >= 10
    assert "503" in paths["/api/v1/readyz"]["get"]["responses"]


# --- host_memory: '1e999' overflowed int(); a long string backtracked for minutes -------------


@pytest.mark.parametrize("host_memory", ["1e999", "1" * 100_000 + "x!", -1, "NaN"])
def test_host_memory_out_of_range_is_422(client: TestClient, host_memory: Any) -> None:
    start = time.perf_counter()
    response = post(client, "estimate", {"model": "tiny-dense", "host_memory": host_memory})
    assert time.perf_counter() - start < 2
    assert_422(response, "host_memory")


def test_host_memory_infinity_token_is_422(client: TestClient) -> None:
    body = b'{"model": "tiny-dense", "host_memory": Infinity}'
    assert_422(post(client, "estimate", body), "host_memory")


# --- config.json integers were int()-ed or tuple()-d unchecked: ValueError, TypeError --------


@pytest.mark.parametrize(
    ("config", "key", "value"),
    [
        (QWEN_MOE, "decoder_sparse_step", "x"),
        (QWEN_MOE, "decoder_sparse_step", [2]),
        (QWEN_MOE, "shared_expert_intermediate_size", {"a": 1}),
        (QWEN_MOE, "mlp_only_layers", 5),
        (QWEN_MOE, "mlp_only_layers", True),
        (DEEPSEEK, "moe_layer_freq", "\x9f"),
        (DEEPSEEK, "n_shared_experts", 1e999),
        (DEEPSEEK, "num_nextn_predict_layers", [1]),
    ],
)
def test_hf_config_non_integers_are_422(
    client: TestClient, config: dict[str, Any], key: str, value: Any
) -> None:
    problem = assert_422(post(client, "estimate", {"model": {**config, key: value}}), key)
    assert problem["field"] == key


def test_hf_config_integral_numbers_still_read() -> None:
    spec = planner.load_model({**QWEN_MOE, "decoder_sparse_step": "2", "moe_intermediate_size": 32})
    assert spec.moe is not None and spec.moe.layer_freq == 2
    spec = planner.load_model({**DEEPSEEK, "n_shared_experts": 1.0})
    assert spec.moe is not None and spec.moe.num_shared_experts == 1


# --- the estimator walks every layer and stage: a huge count hung the worker ------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": {**DENSE, "num_layers": 10**9}}, "model.num_layers"),
        ({"model": {**DENSE, "num_mtp_layers": 10**9}}, "model.num_mtp_layers"),
        ({"model": "tiny-dense", "train": {"parallel": {"pp": 10**9}}}, "train.parallel.pp"),
        (
            {"model": {**MOE, "moe": {**MOE["moe"], "dense_layers": list(range(10**4))}}},
            "model.moe.dense_layers",
        ),
        ({"model": {**QWEN_MOE, "num_hidden_layers": 10**12}}, "model"),  # config.json
    ],
    ids=["layers", "mtp-layers", "pp", "dense-layers", "hf-layers"],
)
def test_huge_layer_counts_are_422_at_once(
    client: TestClient, body: dict[str, Any], field: str
) -> None:
    start = time.perf_counter()
    response = post(client, "estimate", body)
    assert time.perf_counter() - start < 2
    assert_422(response, field, "num_layers" if field == "model" else field)


def test_many_bad_items_make_a_short_message(client: TestClient) -> None:
    moe = {**MOE["moe"], "dense_layers": list(range(4096, 4352))}  # 256 items, all too large
    problem = assert_422(post(client, "estimate", {"model": {**MOE, "moe": moe}}), "model.moe")
    assert len(problem["detail"]) < 2000 and "and 246 more" in problem["detail"]


def test_more_dense_layers_than_the_bound_are_422_naming_the_field(client: TestClient) -> None:
    """Each layer forced dense breaks the layers' pattern, which the backward (and a search
    over it) weighs around every break: at most 256, a regular pattern has layer_freq."""
    moe = {**MOE["moe"], "dense_layers": list(range(257))}
    problem = assert_422(post(client, "fit", {"model": {**MOE, "moe": moe}}), "model.moe")
    assert "at most 256 layer indices" in problem["detail"]


def test_largest_allowed_model_is_estimated_in_time(client: TestClient) -> None:
    huge = {**DENSE, "num_layers": 4096, "num_mtp_layers": 4096, "hidden_size": 2**24}
    irregular = sorted(random.Random(0).sample(range(1, 4096), 256))
    huge["moe"] = {**MOE["moe"], "dense_layers": irregular}
    body = {"model": huge, "train": {"parallel": {"pp": 4096}}}
    start = time.perf_counter()
    response = post(client, "estimate", body)
    assert response.status_code == 200, response.text
    assert response.json()["fits"] is False
    assert time.perf_counter() - start < 10


# --- NaN and infinities reached int(): OverflowError -----------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'"train": {"moe_capacity_factor": Infinity}', "train.moe_capacity_factor"),
        (b'"train": {"moe_imbalance": Infinity}', "train.moe_imbalance"),
        (b'"train": {"moe_imbalance": 1e308}', "train.moe_imbalance"),
        (b'"train": {"offload": {"mode": "optimizer", "fraction": NaN}}', "train.offload"),
        (b'"gpu": {"name": "g", "memory_bytes": 1, "bf16_flops": Infinity}', "gpu.bf16_flops"),
    ],
)
def test_non_finite_numbers_are_422(client: TestClient, raw: bytes, field: str) -> None:
    model = json.dumps(MOE).encode()
    response = post(client, "estimate", b'{"model": ' + model + b", " + raw + b"}")
    assert_422(response, field)


def test_model_capacity_factor_infinity_is_422(client: TestClient) -> None:
    body = {"model": {**MOE, "moe": {**MOE["moe"], "capacity_factor": float("inf")}}}
    assert_422(post(client, "estimate", body), "model.moe.capacity_factor")


# --- a subnormal FLOP/s or link rate divided the step time by ~0: ZeroDivisionError -----------


@pytest.mark.parametrize("rate", ["bf16_flops", "host_link_bytes_per_s"])
def test_subnormal_hardware_rates_are_422(client: TestClient, rate: str) -> None:
    assert_422(post(client, "fit", {"model": "tiny-dense", "gpu": {**GPU, rate: 5e-324}}), "gpu")


# --- a predicted peak past int64 overflowed SQLite's INTEGER ----------------------------------


def test_predicted_peak_beyond_int64_is_422_for_a_calibration(client: TestClient) -> None:
    model = {
        **DENSE,
        "vocab_size": 2**24,
        "hidden_size": 2**24,
        "num_heads": 2**10,
        "ffn_hidden_size": 2**24,
        "num_layers": 512,
    }
    estimate = post(client, "estimate", {"model": model})
    assert estimate.status_code == 200  # JSON has no integer limit: the estimate is fine
    assert estimate.json()["gpu"]["peak_bytes"] > 2**63
    body = {"uid": "int64", "model": model, "measured": {"allocated_bytes": 2**40}}
    assert_422(post(client, "calibrations", body), "model")
    assert client.get("/api/v1/calibrations", params={"limit": 500}).json()["items"] == [
        row for row in client.get("/api/v1/calibrations").json()["items"] if row["uid"] != "int64"
    ]


# --- lone surrogates were stored and then could not be written as UTF-8 JSON ------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": {**DENSE, "source": "\ud800"}}, "model.source"),
        ({"model": {**DENSE, "name": "x\udfff"}}, "model.name"),
        ({"model": "tiny-dense", "gpu": {**GPU, "host_link": "\ud800"}}, "gpu.host_link"),
        ({"model": "tiny-dense", "gpu": {**GPU, "aliases": ["\ud800"]}}, "gpu.aliases"),
        ({"model": "tiny-dense", "gpu": {**GPU, "source": "\ud800"}}, "gpu.source"),
        ({"model": "tiny-dense", "notes": "\ud800"}, "notes"),
    ],
    ids=["model.source", "model.name", "host_link", "aliases", "gpu.source", "notes"],
)
def test_lone_surrogates_are_422(client: TestClient, body: dict[str, Any], field: str) -> None:
    calibration = {**body, "measured": {"allocated_bytes": 2**30}}
    assert_422(post(client, "calibrations", calibration), field)
    if field != "notes":
        assert_422(post(client, "runs", body), field)


# --- preset names were also read as server paths: too long a name was an OSError, /dev/zero
# --- was read forever, and any JSON file on the server was parsed and quoted back -------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "a" * 5000}, "model"),
        ({"model": "tiny-dense", "gpu": "x" * 300 + ".json"}, "gpu"),
        ({"model": "/dev/zero"}, "model"),
        ({"model": "/etc/passwd"}, "model"),
        ({"model": str(Path(planner.__file__).parent / "data/models/tiny-dense.json")}, "model"),
        ({"model": "tiny-dense", "gpu": str(Path(planner.__file__).parent / "data/gpus")}, "gpu"),
    ],
    ids=["long-model", "long-gpu", "dev-zero", "passwd", "json-file", "gpu-folder"],
)
def test_only_preset_names_are_read(client: TestClient, body: dict[str, Any], field: str) -> None:
    start = time.perf_counter()
    problem = assert_422(post(client, "estimate", body), field)
    assert time.perf_counter() - start < 2
    assert "allowed:" in problem["detail"]


def test_planner_reads_only_regular_files() -> None:
    with pytest.raises(planner.UnknownPresetError):
        planner.load_model("/dev/zero")
    with pytest.raises(planner.UnknownPresetError):
        planner.load_model("a" * 5000)


# --- the field of a planner error lacked its prefix ("seq_len" for train.seq_len) ------------


def test_planner_error_field_is_the_full_path(client: TestClient) -> None:
    problem = assert_422(
        post(client, "estimate", {"model": "tiny-dense", "train": {"seq_len": -1}}),
        "train.seq_len",
    )
    assert problem["field"] == "train.seq_len"


# --- PostgreSQL refuses NUL in text and truncates nothing: DataError, StringDataRightTruncation


@pytest.fixture
def any_client(database_url: str) -> Iterator[TestClient]:
    with service_client(database_url, TOKEN) as c:
        yield c


def test_text_the_database_refuses_is_422_on_both_backends(any_client: TestClient) -> None:
    measured = {"allocated_bytes": 2**30}
    ok = post(
        any_client, "calibrations", {"uid": "ok", "model": "tiny-dense", "measured": measured}
    )
    assert ok.status_code == 201, ok.text
    cases = [
        ({"model": "tiny-dense", "notes": "a\x00b"}, "notes"),
        ({"model": {**DENSE, "name": "n" * 201}}, "model.name"),
        ({"model": {**DENSE, "name": "a\x00"}}, "model.name"),
        ({"model": "tiny-dense", "gpu": {**GPU, "name": "g" * 101}}, "gpu.name"),
        ({"model": "tiny-dense", "gpu": {**GPU, "host_link": "\x00"}}, "gpu.host_link"),
    ]
    for body, field in cases:
        assert_422(post(any_client, "calibrations", {**body, "measured": measured}), field)
    for path, params in [
        ("calibrations", {"model": "\x00"}),
        ("calibrations", {"gpu": "a\x00"}),
        ("runs", {"status": "\x00"}),
    ]:
        response = any_client.get(f"/api/v1/{path}", params=params)
        assert_422(response, f"query.{next(iter(params))}")
    rows = any_client.get("/api/v1/calibrations").json()
    assert [row["uid"] for row in rows["items"]] == ["ok"] and rows["total"] == 1
