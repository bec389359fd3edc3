"""The OpenAPI document says what the bodies take: the model and GPU presets by name, the inline
model spec, Hugging Face config.json, hardware and training spec by their schemas, and the host
size's grammar; and the service takes no more than that (booleans are no numbers, numbers no
booleans). Every bound fits a double, as JSON clients read numbers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
from api_client import service_client
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from headroom import planner
from headroom.api import forms
from headroom.planner.hardware import MAX_HOST_MEMORY_BYTES
from headroom.planner.units import _SIZE_RE, _UNITS

TOKEN = "forms-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODIES = ("EstimateRequest", "GateRequest", "FitRequest", "CalibrationIn", "RunIn")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("forms") / "f.db"
    with service_client(f"sqlite:///{db}", TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(client: TestClient) -> dict[str, Any]:
    document: dict[str, Any] = client.get("/api/v1/openapi.json").json()
    return document


def _forms(openapi: dict[str, Any], body: str, field: str) -> list[dict[str, Any]]:
    return list(openapi["components"]["schemas"][body]["properties"][field]["anyOf"])


def _refs(forms: list[dict[str, Any]]) -> set[str]:
    return {f["$ref"].rsplit("/", 1)[-1] for f in forms if "$ref" in f}


@pytest.mark.parametrize("body", BODIES)
def test_model_is_a_preset_name_our_spec_or_a_config_json(
    openapi: dict[str, Any], body: str
) -> None:
    forms_ = _forms(openapi, body, "model")
    assert forms_[0] == {"type": "string", "enum": planner.model_names()}
    assert _refs(forms_) == {"ModelSpec"} | {
        "HFLlamaConfig",
        "HFMistralConfig",
        "HFQwen3Config",
        "HFMixtralConfig",
        "HFQwen2MoEConfig",
        "HFQwen3MoEConfig",
        "HFDeepSeekConfig",
        "HFDeepSeekMoEConfig",
        "HFQwen2Config",
        "HFGemmaConfig",
        "HFGemma2Config",
        "HFGemma3TextConfig",
        "HFGemma3Config",
        "HFOlmoConfig",
        "HFStarcoder2Config",
        "HFCohereConfig",
        "HFCohere2Config",
        "HFInternLM2Config",
    }


@pytest.mark.parametrize("body", BODIES)
def test_gpu_is_a_preset_name_or_alias_or_hardware(openapi: dict[str, Any], body: str) -> None:
    forms_ = _forms(openapi, body, "gpu")
    names = set(forms_[0]["enum"])
    for name in planner.gpu_names():
        assert {name, *planner.gpu(name).aliases} <= names
    assert _refs(forms_) == {"Hardware"}


def test_a_plans_cluster_is_a_preset_name_or_alias_or_cluster(openapi: dict[str, Any]) -> None:
    """A fuzzer sends what the schema allows: a cluster named by any other string is refused
    by the request model, so the schema names the presets (found by a generated request)."""
    forms_ = _forms(openapi, "PlanRequest", "cluster")
    names = set(forms_[0]["enum"])
    for name in planner.cluster_names():
        assert {name, *planner.cluster.cluster_preset(name).aliases} <= names
    assert _refs(forms_) == {"Cluster"}


@pytest.mark.parametrize("body", BODIES)
def test_train_is_the_training_spec(openapi: dict[str, Any], body: str) -> None:
    assert _refs(_forms(openapi, body, "train")) == {"TrainSpec", "StackConfigTrain"}
    profile = openapi["components"]["schemas"]["TrainSpec"]["properties"]["activation_profile"]
    assert profile["enum"] == ["hf", "megatron", "runtime", "textbook", "torchtitan", "torchtune"]


def test_every_bound_is_a_json_schema_keyword_and_fits_a_double(openapi: dict[str, Any]) -> None:
    # pydantic wrote the bounds of a checked number inside a union as "ge"/"le", which no JSON
    # Schema tool reads; and an integer bound past 2^53 is not one a JSON client holds exactly
    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                for key in ("ge", "le", "gt", "lt"):
                    if key in node:
                        yield f"{path}: {key}"
                for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    if node["type"] == "integer" and abs(node.get(key, 0)) > 2**53:
                        yield f"{path}: {key} {node[key]}"
            for key, value in node.items():
                yield from walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{path}[{i}]")

    assert list(walk(openapi["components"], "")) == []


@pytest.mark.parametrize(
    "name",
    sorted(
        p.name
        for p in (resources.files("headroom.planner") / "data" / "hf").iterdir()
        if p.name.endswith(".json")
    ),
)
def test_each_bundled_config_json_is_a_documented_form(name: str) -> None:
    text = (resources.files("headroom.planner") / "data" / "hf" / name).read_text()
    TypeAdapter(forms.HFConfig).validate_python(json.loads(text))


def test_the_config_json_bounds_are_the_model_specs() -> None:
    spec = planner.ModelSpec.model_json_schema()["properties"]
    hf = TypeAdapter(forms.HFLlamaConfig).json_schema()["properties"]
    pairs = {
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "intermediate_size": "ffn_hidden_size",
    }
    for hf_key, spec_key in pairs.items():
        assert hf[hf_key]["maximum"] == spec[spec_key]["maximum"], hf_key
        assert hf[hf_key]["minimum"] == spec[spec_key]["minimum"], hf_key


def _planner_reads(text: str) -> bool:
    """Whether ``planner.parse_size`` reads ``text`` as a size above zero."""
    match = _SIZE_RE.match(text)
    return bool(match and match.group(2).lower() in _UNITS and float(match.group(1)) > 0)


@pytest.mark.parametrize(
    "text",
    [
        "1",
        "0",
        "010",
        "0.0",
        "0.5TiB",
        ".5G",
        "5.",
        "1e9",
        "1E+3kb",
        "1.5 TiB",
        " 80GB ",
        "1x",
        "0e5",
        "1Kib",
        "12 g",
        "1,5GiB",
        "-1GiB",
        "1 TB TB",
        "",
        "NaN",
    ],
)
def test_the_host_size_pattern_is_the_planners_grammar(text: str) -> None:
    assert bool(re.match(forms.SIZE_PATTERN, text)) == _planner_reads(text)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("runs", {"model": "tiny-dense", "probe": 0}, "probe"),
        ("runs", {"model": "tiny-dense", "fit": "true"}, "fit"),
        ("runs", {"model": "tiny-dense", "steps": True}, "steps"),
        ("gate", {"model": "tiny-dense", "require_calibration": 1}, "require_calibration"),
        ("gate", {"model": "tiny-dense", "margin_pct": True}, "margin_pct"),
        (
            "calibrations",
            {
                "model": "tiny-dense",
                "measured": {"allocated_bytes": 1, "forward_transient_bytes": False},
            },
            "measured.forward_transient_bytes",
        ),
        (
            "calibrations",
            {"model": "tiny-dense", "measured": {"allocated_bytes": True}},
            "measured.allocated_bytes",
        ),
        (
            "calibrations",
            {
                "model": "tiny-dense",
                "measured": {"allocated_bytes": 1, "buckets": {"params": True}},
            },
            "measured.buckets.params",
        ),
    ],
)
def test_booleans_and_numbers_are_not_each_other(
    client: TestClient, path: str, body: dict[str, Any], field: str
) -> None:
    response = client.post(f"/api/v1/{path}", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert field in {e["field"] for e in response.json()["errors"]}, response.text


def _tiny(**extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": 64,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "ffn_hidden_size": 128,
        **extra,
    }


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (_tiny(qkv_bias=1), "model.qkv_bias"),
        (_tiny(tied_embeddings="yes"), "model.tied_embeddings"),
        (
            {
                **json.loads(
                    (
                        resources.files("headroom.planner") / "data" / "hf" / "llama-3-8b.json"
                    ).read_text()
                ),
                "tie_word_embeddings": 1,
            },
            "tie_word_embeddings",
        ),
    ],
)
def test_a_spec_takes_only_booleans_for_its_switches(
    client: TestClient, model: dict[str, Any], field: str
) -> None:
    response = client.post("/api/v1/estimate", json={"model": model}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field, response.text


def test_host_memory_is_at_most_one_pib(client: TestClient) -> None:
    limit = MAX_HOST_MEMORY_BYTES
    ok = client.post("/api/v1/estimate", json={"model": "tiny-dense", "host_memory": limit})
    assert ok.status_code == 200, ok.text
    over = client.post("/api/v1/estimate", json={"model": "tiny-dense", "host_memory": limit + 1})
    assert over.status_code == 422 and over.json()["field"] == "host_memory", over.text
    assert "1 PiB" in over.json()["detail"]


def test_a_cluster_objects_gpu_is_a_gpu_preset(openapi: dict[str, Any], client: TestClient) -> None:
    """Every field that takes a preset's name lists the names: the cluster object's GPU (a
    plain string in the OpenAPI, and with a GPU of the body any string was taken) too."""
    gpu = openapi["components"]["schemas"]["Cluster"]["properties"]["gpu"]
    assert gpu["enum"] == _forms(openapi, "EstimateRequest", "gpu")[0]["enum"]
    assert set(planner.gpu_names()) <= set(gpu["enum"])
    cluster = {
        "name": "mine",
        "gpu": "not-a-gpu",
        "gpus_per_node": 8,
        "intra_node_bytes_per_s": 1e11,
        "inter_node_bytes_per_s": 1e10,
    }
    body = {"model": "tiny-dense", "gpus": 8, "global_batch": 8, "seq_len": 128}
    for gpu_of_the_body in ({}, {"gpu": "H100-80GB"}):
        response = client.post(
            "/api/v1/plan", json={**body, **gpu_of_the_body, "cluster": cluster}, headers=AUTH
        )
        assert response.status_code == 422, response.text
        assert "cluster.Cluster.gpu" in {e["field"] for e in response.json()["errors"]}
        assert "allowed: A100-40GB" in response.json()["detail"], response.text
    # a preset by an alias in any case, as the body's gpu takes it
    named = {**body, "cluster": {**cluster, "gpu": "H100-sxm"}}
    assert client.post("/api/v1/plan", json=named, headers=AUTH).status_code == 200


_TINY_SPEC = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_hidden_size": 128,
}
_HARDWARE = {**planner.gpu("H100-80GB").model_dump(mode="json"), "aliases": []}
_CLUSTER = {
    "name": "mine",
    "gpu": "H100-80GB",
    "gpus_per_node": 8,
    "intra_node_bytes_per_s": 1e11,
    "inter_node_bytes_per_s": 1e10,
}
#: a body each route accepts, with every object form given (so each nested count is reached)
_ACCEPTED = {
    "estimate": (
        "EstimateRequest",
        {"model": _TINY_SPEC, "gpu": _HARDWARE, "step": True, "cluster": _CLUSTER},
    ),
    "plan": (
        "PlanRequest",
        {"model": _TINY_SPEC, "gpus": 8, "global_batch": 8, "seq_len": 128, "cluster": _CLUSTER},
    ),
    "calibrations": (
        "CalibrationIn",
        {"model": _TINY_SPEC, "gpu": _HARDWARE, "measured": {"allocated_bytes": 10**8}},
    ),
    "runs": (
        "RunIn",
        {
            "model": planner.load_model("tiny-dense").model_dump(mode="json"),
            "gpu": _HARDWARE,
            "backend": "slurm",
            "slurm": {},
        },
    ),
}


def _integer_fields(
    schemas: dict[str, Any], schema: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """The path of every integer field under ``schema`` (Hugging Face configs aside: the
    bodies give our model spec)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if not name.startswith("HF"):
            yield from _integer_fields(schemas, schemas[name], path)
        return
    if schema.get("type") == "integer":
        yield path
    for form in schema.get("anyOf", []):
        yield from _integer_fields(schemas, form, path)
    for key, field in schema.get("properties", {}).items():
        yield from _integer_fields(schemas, field, (*path, key))


@pytest.mark.parametrize("route", sorted(_ACCEPTED))
def test_no_integer_field_of_a_body_takes_a_boolean(
    openapi: dict[str, Any], client: TestClient, route: str
) -> None:
    """Each count a body takes, at any depth, refuses ``true`` with a 422 naming it (the
    Slurm allocation of a run took ``nodes: true`` as one node); a whole number written as
    ``2.0`` is that integer, as JSON Schema's ``integer`` says."""
    name, accepted = _ACCEPTED[route]
    assert client.post(f"/api/v1/{route}", json=accepted, headers=AUTH).status_code < 300
    schemas = openapi["components"]["schemas"]
    fields = sorted(set(_integer_fields(schemas, schemas[name])))
    assert len(fields) >= 4, fields
    for path in fields:
        body = json.loads(json.dumps(accepted))
        node = body
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):  # an object the body left out (or null)
                node[key] = {}
            node = node[key]
        node[path[-1]] = True
        response = client.post(f"/api/v1/{route}", json=body, headers=AUTH)
        assert response.status_code == 422, (path, response.text)
        named = f"{response.json()['detail']} {response.json().get('field')}"
        assert path[-1] in named, (path, response.text)
    if route == "runs":
        for count in ("nodes", "gpus_per_node"):
            body = {**accepted, "slurm": {count: 2.0}}
            created = client.post(f"/api/v1/{route}", json=body, headers=AUTH)
            assert created.status_code == 201, created.text
            assert created.json()["plan"]["slurm"][count] == 2


@pytest.mark.parametrize(
    "time_limit", ["0", "-1", "00:00:00", "0-0", "0:30", "UNLIMITED", "INFINITE", "366-0", " 1"]
)
def test_a_runs_slurm_time_limit_is_a_minute_to_a_year(client: TestClient, time_limit: str) -> None:
    """A time limit of 0 or -1 is none at all to Slurm (the run ran unlimited): refused with
    the forms and range allowed."""
    body = {"model": "tiny-dense", "backend": "slurm", "slurm": {"time_limit": time_limit}}
    response = client.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["field"] == "slurm.time_limit", problem
    assert problem["detail"].startswith("slurm.time_limit: "), problem
    assert "allowed: 1 minute to 365 days as M, M:S, H:M:S, D-H" in problem["detail"], problem


@pytest.mark.parametrize("time_limit", ["1", "0:60", "01:00:00", "2-0", "1-12:30", "365-0:0:0"])
def test_a_slurm_time_limit_in_each_of_slurms_forms_is_taken(
    client: TestClient, time_limit: str
) -> None:
    body = {"model": "tiny-dense", "backend": "slurm", "slurm": {"time_limit": time_limit}}
    created = client.post("/api/v1/runs", json=body, headers=AUTH)
    assert created.status_code == 201, created.text
    assert created.json()["plan"]["slurm"]["time_limit"] == time_limit
