"""A body's ``train`` as the stack's own config (``train.stack_config``): the same spec, and the
same answer, as ``--train`` gives the file on the command line; what the file does not say is
a line of the answer's warnings; a file that is none of the stacks' is a 422 naming it, and
nothing is read from the service's disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app
from headroom.cli.options import train_dict

ROOT = Path(__file__).resolve().parents[2]
TOML = ROOT / "docs" / "examples" / "torchtitan-llama3_8b.toml"
DATA = ROOT / "tests" / "data" / "stack-configs"
RUNS = {
    run["id"]: run
    for run in json.loads((ROOT / "calibration" / "data" / "published-memory.json").read_text())[
        "runs"
    ]
}

client = TestClient(create_app())


def _estimate(model: str | dict[str, Any], train: dict[str, Any], gpu: str) -> int:
    budget = planner.estimate(
        planner.load_model(model), planner.load_train(train), planner.gpu(gpu)
    )
    return budget.gpu.peak_bytes


def _sent(*paths: Path, **extra: Any) -> dict[str, Any]:
    files = [{"name": p.name, "text": p.read_text()} for p in paths]
    return {"stack_config": files, **extra}


def test_a_torchtitan_toml_sent_as_text_is_what_train_gives_on_the_command_line() -> None:
    model = planner.load_model("llama-3-8b")
    want = _estimate("llama-3-8b", train_dict(TOML, [], model), "H100-80GB")
    body = {"model": "llama-3-8b", "gpu": "H100-80GB", "train": _sent(TOML)}
    answer = client.post("/api/v1/estimate", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["gpu"]["peak_bytes"] == want
    # what the TOML leaves to the launch is said, once, as the CLI says it on stderr
    (line,) = [w for w in got["warnings"] if w.startswith("train: ")]
    assert "torchtitan config" in line and "data_parallel_shard_degree -1" in line
    verdict = client.post("/api/v1/gate", json=body).json()
    assert line in verdict["warnings"] and verdict["decision"] in ("fits", "oom")
    # set: keys over the mapped config, as --set's
    bigger = {**body, "train": _sent(TOML, set={"parallel.dp": 64, "micro_batch_size": 2})}
    overridden = _estimate(
        "llama-3-8b", train_dict(TOML, ["parallel.dp=64", "micro_batch_size=2"], model), "H100-80GB"
    )
    again = client.post("/api/v1/estimate", json=bigger)
    assert again.status_code == 200, again.text
    assert again.json()["gpu"]["peak_bytes"] == overridden != want


@pytest.mark.parametrize(
    ("run_id", "ds"),
    [
        ("llamafactory_l3_8b_full_zero3_8x3090_oom", "ds_z3_config.json"),
        ("llamafactory_l3_8b_full_zero3_offload_8x3090_fit", "ds_z3_offload_config.json"),
    ],
)
def test_an_hf_yaml_and_the_deepspeed_config_it_names_map_to_the_published_runs_spec(
    run_id: str, ds: str
) -> None:
    """LLaMA-Factory issue #5977's runs: the YAML first, its DeepSpeed JSON beside it (found by
    its base name, as the YAML names it by a path of the user's checkout); the "auto" buckets
    sized by the body's model."""
    folder = DATA / "llamafactory_issue5977_l3_8b_8x3090"
    text = (folder / "llama3_full_sft_ds3.yaml").read_text().replace("bf16: true", "fp16: true")
    text = text.replace("examples/deepspeed/ds_z3_config.json", f"examples/deepspeed/{ds}")
    files = [
        {"name": "llama3_full_sft_ds3.yaml", "text": text},
        {"name": ds, "text": (folder / ds).read_text()},
    ]
    run = RUNS[run_id]
    gpu = run["spec"]["gpu"]
    body = {"model": "llama-3-8b", "gpu": gpu, "train": {"stack_config": files}}
    answer = client.post("/api/v1/estimate", json=body)
    assert answer.status_code == 200, answer.text
    want = _estimate("llama-3-8b", run["spec"]["train"], gpu)
    assert answer.json()["gpu"]["peak_bytes"] == want


def test_a_megatron_functional_tests_yaml_maps_to_the_published_runs_spec() -> None:
    run = RUNS["mlm_gpt7b_gqa_tp4_dp2_mbs2_8k_h100"]
    path = DATA / "mlm_gpt7b_gqa_tp4_dp2_mbs2_8k_h100" / "model_config.yaml"
    spec = run["spec"]
    body = {"model": spec["model"], "gpu": spec["gpu"], "train": _sent(path)}
    answer = client.post("/api/v1/estimate", json=body)
    assert answer.status_code == 200, answer.text
    want = _estimate(spec["model"], spec["train"], spec["gpu"])
    assert answer.json()["gpu"]["peak_bytes"] == want


def test_a_plan_keeps_to_the_layout_a_stacks_config_names() -> None:
    """The TOML's tensor-parallel degree is a constraint of the plan, as a training spec's is."""
    text = TOML.read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    body = {
        "model": "llama-3-8b",
        "gpu": "H100-80GB",
        "gpus": 8,
        "global_batch": 4,
        "seq_len": 8192,
        "train": {"stack_config": [{"name": "llama3_8b.toml", "text": text}]},
    }
    answer = client.post("/api/v1/plan", json=body)
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    assert plan["fits"] and plan["plan"]["parallel"]["tp"] == 2
    assert any(
        w.startswith("train: llama3_8b.toml: torchtitan config") for w in plan["budget"]["warnings"]
    )


def _refusal(train: dict[str, Any]) -> str:
    answer = client.post("/api/v1/estimate", json={"model": "llama-3-8b", "train": train})
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    problem = answer.json()
    # a file's content is refused as the planner refuses a spec; a body not of the documented
    # shape, by the request model
    field = problem["field"] if "field" in problem else problem["errors"][0]["field"]
    assert field.startswith("train"), problem
    return str(problem["detail"])


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ([{"name": "notes.txt", "text": "hello"}], "notes.txt: not a stack's training config"),
        ([{"name": "a.toml", "text": "[job]\nx = 1\n"}], "torchtitan's job config"),
        ([{"name": "a.toml", "text": "x = " + "[" * 3000 + "]" * 3000}], "a.toml: not valid"),
        (
            [{"name": "a.json", "text": "[" * 20_000 + "]" * 20_000}],
            "a.json: not a stack's training config",
        ),
        # the file the YAML names is looked for among the files sent, never on the disk
        (
            [{"name": "t.yaml", "text": "deepspeed: /etc/passwd\nbf16: true\n"}],
            "deepspeed: /etc/passwd is not beside it",
        ),
        (
            [{"name": "t.yaml", "text": "deepspeed: ds.json\n"}, {"name": "ds.json", "text": "{}"}],
            "ds.json: not a DeepSpeed config",
        ),
        (
            [{"name": "t.yaml", "text": "a: &x [1, 2]\nb: [*x, *x]\ndeepspeed: ds.json\n"}],
            "t.yaml: a YAML alias",
        ),
        ([], "stack_config: List should have at least 1 item"),
        ([{"name": "a.toml"}], "stack_config.0.text: Field required"),
    ],
)
def test_a_file_that_is_no_stacks_config_is_a_422_naming_it(
    files: list[dict[str, str]], says: str
) -> None:
    assert says in _refusal({"stack_config": files})


def test_a_training_key_beside_the_stack_config_is_refused_with_the_allowed_ones() -> None:
    detail = _refusal({"stack_config": [{"name": "a.toml", "text": TOML.read_text()}], "seq": 1})
    assert "seq: unknown field" in detail and "set, stack_config" in detail
    bad = _refusal(
        {"stack_config": [{"name": "a.toml", "text": TOML.read_text()}], "set": {"a=b": 1}}
    )
    assert "train.a=b: unknown field" in bad  # a key set is a training spec key
    # a value set is checked as the training spec's own (after the mapping)
    train = {"stack_config": [{"name": "a.toml", "text": TOML.read_text()}], "set": {"seq_len": -1}}
    answer = client.post("/api/v1/estimate", json={"model": "llama-3-8b", "train": train})
    assert answer.status_code == 422 and "train.seq_len" in answer.json()["detail"], answer.text
