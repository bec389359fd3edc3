"""The Kubeflow PyTorchJob a plan renders to (``launch.k8s``, ``headroom launch --backend k8s
--dry-run``): byte for byte against a committed golden file, validated against the published
schema through the Kubeflow training SDK's models (generated from the CRD's OpenAPI schema), and
printed by the command line without anything stored.

The golden file is ``tests/launch/data/pytorchjob-golden.yaml``; regenerate it only for an
intended change of the manifest (or of the specs it carries), with ``PYTHONPATH=.:tests
.venv/bin/python tests/launch/test_k8s_manifest.py --write`` from the repository's root.

The SDK's ``ApiClient`` deserializes leniently: it reads only the keys its models name (an
unknown key is dropped without a word) and casts a primitive to the declared type (``1`` where a
string is due becomes ``"1"``). A manifest is therefore held to the schema by deserializing it
with client-side validation on (required fields) and serializing the model back: the result must
equal the manifest, so every key is one the schema has and every value has the schema's type.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import processes
import pytest
import yaml

from headroom import planner
from headroom.launch import k8s
from headroom.launch.plan import RunPlan

GOLDEN = Path(__file__).resolve().parent / "data" / "pytorchjob-golden.yaml"
#: how to write the golden file again (from the repository's root)
REGENERATE = "PYTHONPATH=.:tests .venv/bin/python tests/launch/test_k8s_manifest.py --write"
#: the golden run: fixed specs (optimizer offload, so the host budget is not zero), uid and shape
GOLDEN_UID = "0123456789abcdef0123456789abcdef"
GOLDEN_SETTINGS = {
    "image": "registry.example.com/ml/headroom:0.1.0",
    "namespace": "ml-team",
    "gpus_per_node": 1,
    "ranks_per_node": 1,
}
TINY_SETS = ["--set", "seq_len=16", "--set", "micro_batch_size=1"]


def golden_plan() -> RunPlan:
    """tiny-dense on an H100 with half its optimizer on the host, as given (not fitted)."""
    return RunPlan.estimated(
        planner.load_model("tiny-dense"),
        planner.TrainSpec.model_validate(
            {
                "seq_len": 16,
                "micro_batch_size": 1,
                "offload": {"mode": "optimizer", "fraction": 0.5},
                "expandable_segments": True,
            }
        ),
        planner.gpu("H100-80GB"),
    )


def golden_documents() -> list[dict[str, Any]]:
    return k8s.manifests(
        golden_plan(),
        uid=GOLDEN_UID,
        steps=100,
        device="cuda",
        nodes=2,
        settings=k8s.K8sSettings(**GOLDEN_SETTINGS),
    )


def _round_trip(client: Any, data: dict[str, Any], klass: str) -> Any:
    """``data`` deserialized into the SDK's model ``klass`` and serialized back."""
    model = client._ApiClient__deserialize(data, klass)
    return client.sanitize_for_serialization(model)


def _job_round_trip(job: dict[str, Any]) -> Any:
    from kubeflow.training import ApiClient, Configuration

    assert Configuration().client_side_validation
    return _round_trip(ApiClient(), job, "KubeflowOrgV1PyTorchJob")


def _config_map_round_trip(config_map: dict[str, Any]) -> Any:
    from kubernetes.client import ApiClient, Configuration

    assert Configuration().client_side_validation
    return _round_trip(ApiClient(), config_map, "V1ConfigMap")


def test_the_golden_run_renders_byte_identical_to_the_committed_manifest() -> None:
    rendered = k8s.render_yaml(golden_documents())
    assert rendered == GOLDEN.read_text(), (
        "the rendered PyTorchJob differs from tests/launch/data/pytorchjob-golden.yaml; if the "
        f"change is intended: {REGENERATE}"
    )


def test_the_yaml_stream_parses_back_into_the_config_map_and_the_pytorchjob() -> None:
    documents = golden_documents()
    parsed = list(yaml.safe_load_all(k8s.render_yaml(documents)))
    assert parsed == documents
    assert [(d["apiVersion"], d["kind"]) for d in parsed] == [
        ("v1", "ConfigMap"),
        ("kubeflow.org/v1", "PyTorchJob"),
    ]


@pytest.mark.parametrize(
    ("nodes", "device", "ranks"), [(2, "cuda", 1), (1, "cuda", 1), (1, "cpu", 1), (3, "cuda", 4)]
)
def test_the_pytorchjob_and_its_config_map_hold_only_what_the_kubeflow_sdk_schema_has(
    nodes: int, device: str, ranks: int
) -> None:
    settings = k8s.K8sSettings(**{**GOLDEN_SETTINGS, "ranks_per_node": ranks})
    config_map, job = k8s.manifests(
        golden_plan(), uid=GOLDEN_UID, steps=5, device=device, nodes=nodes, settings=settings
    )
    assert _job_round_trip(job) == job
    assert _config_map_round_trip(config_map) == config_map


def test_the_schema_round_trip_catches_an_unknown_key_and_a_mistyped_value() -> None:
    """The check above has teeth: the SDK drops what its schema lacks and casts what has the
    wrong type, so the round trip differs from a manifest with either."""
    _, job = golden_documents()
    unknown = copy.deepcopy(job)
    unknown["spec"]["runPolicy"]["backOffLimit"] = 0  # misspelt backoffLimit
    assert _job_round_trip(unknown) != unknown
    container = copy.deepcopy(job)
    container["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resourcez"
    ] = {}
    assert _job_round_trip(container) != container
    mistyped = copy.deepcopy(job)
    mistyped["spec"]["nprocPerNode"] = 1  # the schema's is a string
    assert _job_round_trip(mistyped) != mistyped
    quantity = copy.deepcopy(job)
    quantity["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"]["nvidia.com/gpu"] = 1  # a quantity is a string
    assert _job_round_trip(quantity) != quantity


def test_a_container_without_its_required_name_is_refused_by_client_side_validation() -> None:
    _, job = golden_documents()
    del job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        _job_round_trip(job)


def _container(job: dict[str, Any], replica: str) -> dict[str, Any]:
    spec = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
    containers: list[dict[str, Any]] = spec["containers"]
    assert [c["name"] for c in containers] == ["pytorch"]  # the operator's container
    return containers[0]


def test_the_job_shape_replicas_restart_policy_and_resources_follow_the_settings() -> None:
    config_map, job = golden_documents()
    name = f"headroom-{GOLDEN_UID}"
    assert job["metadata"]["name"] == name and job["metadata"]["namespace"] == "ml-team"
    assert config_map["metadata"] == {
        "name": f"{name}-specs",
        "namespace": "ml-team",
        "labels": job["metadata"]["labels"],
    }
    spec = job["spec"]
    assert spec["nprocPerNode"] == "1" and spec["runPolicy"]["backoffLimit"] == 0
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: (r["replicas"], r["restartPolicy"]) for k, r in replicas.items()} == {
        "Master": (1, "Never"),
        "Worker": (1, "Never"),
    }
    for replica in ("Master", "Worker"):
        container = _container(job, replica)
        assert container["image"] == GOLDEN_SETTINGS["image"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        pod = replicas[replica]["template"]["spec"]
        assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "specs", "configMap": {"name": f"{name}-specs"}} in pod["volumes"]
        assert container["env"] == [
            {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}
        ]
    one = k8s.manifests(
        golden_plan(),
        uid=GOLDEN_UID,
        steps=100,
        device="cuda",
        nodes=1,
        settings=k8s.K8sSettings(image="headroom:latest", gpus_per_node=8, ranks_per_node=8),
    )[1]
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"]  # no Worker on one node
    assert "namespace" not in one["metadata"] and one["spec"]["nprocPerNode"] == "8"
    assert _container(one, "Master")["resources"]["limits"] == {"nvidia.com/gpu": "8"}


def test_the_pods_run_the_trainer_with_write_specs_arguments_on_the_mounted_specs() -> None:
    from headroom.launch.supervisor import spec_documents, trainer_args

    plan = golden_plan()
    config_map, job = golden_documents()
    args = trainer_args(
        plan, steps=100, device="cuda", specs=k8s.SPECS_DIR, report=k8s.WORK_DIR / "report.json"
    )
    assert args[:2] == ["/etc/headroom/run/model.json", "--train"]
    torchrun = ["python", "-m", "torch.distributed.run", "-m", "headroom", "train"]
    assert _container(job, "Master")["command"] == [*torchrun, *args]  # two nodes
    assert {"name": "specs", "mountPath": "/etc/headroom/run", "readOnly": True} in _container(
        job, "Master"
    )["volumeMounts"]
    # the ConfigMap carries the specs write_specs would write, under the names the args give
    assert {k: json.loads(v) for k, v in config_map["data"].items()} == spec_documents(plan)
    # one rank: the trainer itself, its exit code (3: out of memory) the pod's; a CPU run
    # simulates the planned card's memory as a local one does
    single = k8s.manifests(
        plan, uid="x", steps=3, device="cpu", nodes=1, settings=k8s.K8sSettings()
    )[1]
    cpu_args = trainer_args(
        plan, steps=3, device="cpu", specs=k8s.SPECS_DIR, report=k8s.WORK_DIR / "report.json"
    )
    assert "--memory-cap" in cpu_args
    assert _container(single, "Master")["command"] == [
        "python", "-m", "headroom", "train", *cpu_args,
    ]  # fmt: skip


def test_the_memory_request_is_the_predicted_host_peak_and_each_ranks_process() -> None:
    plan = golden_plan()
    predicted = plan.predicted()
    assert predicted.host_peak_bytes > 0  # the offloaded optimizer's host state
    for device, ranks in (("cuda", 1), ("cuda", 4), ("cpu", 2)):
        settings = k8s.K8sSettings(gpus_per_node=4, ranks_per_node=ranks)
        job = k8s.manifests(plan, uid="m", steps=1, device=device, nodes=1, settings=settings)[1]
        per_rank = k8s.TRAINER_PROCESS_BYTES
        if device == "cpu":
            per_rank += predicted.gpu_peak_bytes - plan.hw.cuda_context_bytes
        expected = predicted.host_peak_bytes + ranks * per_rank
        requests = _container(job, "Master")["resources"]["requests"]
        assert requests == {"cpu": str(ranks), "memory": f"{-(-expected // 2**20)}Mi"}


@pytest.mark.parametrize(
    ("uid", "name"),
    [
        ("0123456789abcdef0123456789abcdef", "headroom-0123456789abcdef0123456789abcdef"),
        ("Run_42/A", "headroom-run-42-a"),
        ("x" * 80, "headroom-" + "x" * (k8s.NAME_MAX - len("headroom-"))),
    ],
)
def test_the_job_name_is_a_dns_label_from_the_uid_short_enough_for_its_pods_services(
    uid: str, name: str
) -> None:
    assert k8s.job_name(uid) == name
    assert len(f"{name}-worker-1022") <= 63


def _launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """``headroom launch``, bound: past the timeout it and what it started are killed."""
    return processes.run(
        [sys.executable, "-m", "headroom", "launch", "tiny-dense", *TINY_SETS, *args],
        timeout=120,
        cwd=tmp_path,
        env={
            **os.environ,
            "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/runs.db",
            "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
            **(env or {}),
        },
    )


def test_headroom_launch_backend_k8s_dry_run_prints_the_two_documents_and_stores_nothing(
    tmp_path: Path,
) -> None:
    settings = {
        "HEADROOM_K8S_IMAGE": "registry.example.com/headroom:1",
        "HEADROOM_K8S_NAMESPACE": "ml",
    }
    done = _launch(
        tmp_path, "--set", "parallel.dp=2", "--backend", "k8s", "--dry-run", "--k8s-nodes", "2",
        "--k8s-gpus-per-node", "2", env=settings,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config_map, job = yaml.safe_load_all(done.stdout)
    assert config_map["kind"] == "ConfigMap" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["namespace"] == "ml" and config_map["metadata"]["namespace"] == "ml"
    master = _container(job, "Master")
    assert master["image"] == "registry.example.com/headroom:1"
    assert master["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert master["command"][master["command"].index("--device") + 1] == "cuda"  # it has GPUs
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert _job_round_trip(job) == job and _config_map_round_trip(config_map) == config_map
    assert not (tmp_path / "runs.db").exists() and not (tmp_path / "runs").exists()
    listed = _launch(tmp_path, "--backend", "k8s", "--dry-run", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    items = json.loads(listed.stdout)["items"]
    assert [d["kind"] for d in items] == ["ConfigMap", "PyTorchJob"]
    command = _container(items[1], "Master")["command"]
    assert command[command.index("--device") + 1] == "cpu" and "--memory-cap" in command  # no GPUs
    assert not (tmp_path / "runs.db").exists()


def test_backend_k8s_without_dry_run_exits_2_naming_dry_run(tmp_path: Path) -> None:
    refused = _launch(tmp_path, "--backend", "k8s")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "--dry-run" in refused.stderr and "not submitted" in refused.stderr, refused.stderr
    assert not (tmp_path / "runs.db").exists()


def test_dry_run_with_another_backend_exits_2_naming_the_option(tmp_path: Path) -> None:
    for backend in ("local", "slurm"):
        refused = _launch(tmp_path, "--backend", backend, "--dry-run")
        assert refused.returncode == 2, refused.stderr
        assert "--dry-run" in refused.stderr and backend in refused.stderr
    assert not (tmp_path / "runs.db").exists()


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--k8s-image", "repo/headroom:1"], {}, "--k8s-image"),  # without --backend k8s
        (["--backend", "k8s", "--dry-run", "--k8s-namespace", "ML_Team"], {}, "--k8s-namespace"),
        (["--backend", "k8s", "--dry-run", "--k8s-image", "a b"], {}, "--k8s-image"),
        (["--backend", "k8s", "--dry-run"], {"HEADROOM_K8S_IMAGE": "a;b"}, "HEADROOM_K8S_IMAGE"),
        (["--backend", "k8s", "--dry-run", "--slurm-nodes", "2"], {}, "--slurm-nodes"),
        (["--backend", "k8s", "--dry-run", "--device", "cuda"], {}, "--device"),
        (["--backend", "k8s", "--dry-run", "--probe"], {}, "--probe"),
    ],
)
def test_a_k8s_option_or_setting_that_cannot_apply_exits_2_naming_it(
    tmp_path: Path, args: list[str], env: dict[str, str], named: str
) -> None:
    refused = _launch(tmp_path, *args, env=env)
    assert refused.returncode == 2 and named in refused.stderr, refused.stderr
    assert not (tmp_path / "runs.db").exists()


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(k8s.render_yaml(golden_documents()))
        print(f"wrote {GOLDEN}")
        return 0
    print(f"usage: {REGENERATE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


def test_a_k8s_dry_run_splits_parallel_dp_over_its_pods(tmp_path: Path) -> None:
    """``parallel.dp`` data-parallel ranks over ``--k8s-nodes`` pods (``nprocPerNode``); a data
    parallelism the pods cannot split evenly exits 2 naming ``parallel.dp``."""
    done = _launch(
        tmp_path, "--set", "parallel.dp=4", "--backend", "k8s", "--dry-run", "--k8s-nodes", "2"
    )
    assert done.returncode == 0, done.stderr
    job = list(yaml.safe_load_all(done.stdout))[1]
    assert job["spec"]["nprocPerNode"] == "2"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    uneven = _launch(
        tmp_path, "--set", "parallel.dp=3", "--backend", "k8s", "--dry-run", "--k8s-nodes", "2"
    )
    assert uneven.returncode == 2 and "parallel.dp" in uneven.stderr, uneven.stderr
