"""Kubernetes: a plan rendered as a Kubeflow PyTorchJob, for the user to apply.

``manifests`` turns a validated plan into two documents: a ConfigMap holding the run's specs
(``model.json``, ``train.json``, as ``supervisor.spec_documents`` makes them) and a
``kubeflow.org/v1`` PyTorchJob whose ``Master`` (one replica) and ``Worker`` (nodes - 1
replicas, none on one node) pods run the bundled trainer with the arguments
``supervisor.trainer_args`` builds, pointed at the ConfigMap mounted at ``SPECS_DIR``. Each pod
asks for ``gpus_per_node`` GPUs (``nvidia.com/gpu``), one CPU per rank and the plan's
predicted host RAM per node (``TRAINER_PROCESS_BYTES`` per rank on top, and a CPU run's
simulated devices), and mounts a memory-backed ``/dev/shm`` for its pinned host buffers. The
trainer ends the pod: ``restartPolicy: Never`` and ``backoffLimit: 0``, so an out-of-memory
exit 3 is the job's failure, never retried. ``render_yaml`` prints them as one YAML stream.

The image, namespace, GPUs and ranks per node come from ``HEADROOM_K8S_*`` (``K8sSettings``),
each but the ranks overridable per launch (``K8sOverrides``). Nothing here talks to a cluster:
``headroom launch --backend k8s --dry-run`` prints the manifest and the user applies it
(``kubectl apply -f``); Headroom neither submits nor watches it. The training operator starts
the pods with ``MASTER_ADDR``, ``PET_NNODES``, ``PET_NPROC_PER_NODE`` and ``PET_NODE_RANK`` in
their environment, which ``torchrun`` reads, so more than one rank runs the trainer under it
with no arguments of its own; one rank runs the trainer itself, whose exit code is the pod's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from headroom.launch.plan import RunPlan
from headroom.launch.settings import ClusterShape
from headroom.launch.supervisor import spec_documents, trainer_args
from headroom.planner._numbers import Int

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
#: the container the training operator sets up (its name is the operator's requirement)
CONTAINER = "pytorch"
#: where the specs' ConfigMap is mounted (read-only) in the trainer's container
SPECS_DIR = PurePosixPath("/etc/headroom/run")
#: the trainer's working directory and its report's, a scratch volume of the pod
WORK_DIR = PurePosixPath("/var/lib/headroom")
#: host RAM one trainer process holds besides the planned host state (the interpreter, torch,
#: the CUDA runtime's host side): a round allowance, not a measurement
TRAINER_PROCESS_BYTES = 2 * 2**30
#: what a namespace may be (a DNS-1123 label)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: what an image reference may hold ([registry/]repository[:tag][@digest]; no spaces or quotes)
IMAGE = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
#: the longest job name: its pods' services are ``NAME-worker-INDEX``, DNS-1035 labels of at
#: most 63 characters, and a job has at most 1024 nodes
NAME_MAX = 63 - len("-worker-1022")


class K8sSettings(BaseSettings):
    """What rendered jobs run and where (``HEADROOM_K8S_*``; all but the ranks overridable per
    launch)."""

    model_config = SettingsConfigDict(env_prefix="HEADROOM_K8S_", extra="ignore")

    image: str = Field(
        default="headroom:latest",
        min_length=1,
        max_length=500,
        pattern=IMAGE,
        description="The container image: Headroom and torch installed, `python` on its PATH.",
    )
    namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,
        description="metadata.namespace (unset: kubectl's current namespace).",
    )
    gpus_per_node: Int = Field(default=0, ge=0, le=64, description="GPUs each pod is given.")
    ranks_per_node: Int = Field(
        default=1, ge=1, le=256, description="Trainer processes per pod (nprocPerNode)."
    )


class K8sOverrides(ClusterShape):
    """One launch's own job shape, over ``K8sSettings``' (None: the setting's); its nodes
    are pods."""

    image: str | None = Field(
        default=None, min_length=1, max_length=500, pattern=IMAGE, description="Container image."
    )
    namespace: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=DNS_LABEL, description="Namespace."
    )


def job_name(uid: str) -> str:
    """The job's name for a run's ``uid``: ``headroom-`` and the uid, lowercased, every run of
    characters a DNS label may not hold made one ``-``, cut to ``NAME_MAX``."""
    name = "headroom-" + re.sub(r"[^a-z0-9]+", "-", uid.lower())
    return name[:NAME_MAX].rstrip("-")


def _mebibytes(size: int) -> str:
    """``size`` bytes as a Kubernetes quantity, rounded up to a whole MiB."""
    return f"{max(1, math.ceil(size / 2**20))}Mi"


def host_memory_bytes(plan: RunPlan, device: str, ranks_per_node: int) -> int:
    """The host RAM one pod asks for: the plan's predicted host peak (the planner's ``host``
    budget, per node) and ``TRAINER_PROCESS_BYTES`` per rank; on the CPU each rank's simulated
    device too (its card's memory but the CUDA context)."""
    predicted = plan.predicted()
    per_rank = TRAINER_PROCESS_BYTES
    if device == "cpu":
        per_rank += max(0, predicted.gpu_peak_bytes - plan.hw.cuda_context_bytes)
    return predicted.host_peak_bytes + ranks_per_node * per_rank


def _pod_template(
    image: str,
    labels: dict[str, str],
    command: list[str],
    env: list[dict[str, str]],
    resources: dict[str, Any],
    config_map: str,
) -> dict[str, Any]:
    """One replica's pod: the trainer's container, its specs, scratch and shared memory."""
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "workingDir": str(WORK_DIR),
    }
    if env:
        container["env"] = env
    container["resources"] = resources
    container["volumeMounts"] = [
        {"name": "specs", "mountPath": str(SPECS_DIR), "readOnly": True},
        {"name": "work", "mountPath": str(WORK_DIR)},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    return {
        "metadata": {"labels": labels},
        "spec": {
            "containers": [container],
            "volumes": [
                {"name": "specs", "configMap": {"name": config_map}},
                {"name": "work", "emptyDir": {}},
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def manifests(
    plan: RunPlan,
    *,
    uid: str,
    steps: int,
    device: str,
    nodes: int,
    settings: K8sSettings,
) -> list[dict[str, Any]]:
    """The ConfigMap of ``plan``'s specs and the PyTorchJob that trains it for ``steps`` steps
    on ``device`` (``cuda`` or ``cpu``), ``nodes`` pods of ``settings.ranks_per_node`` ranks,
    named after ``uid`` (see the module docstring)."""
    name = job_name(uid)
    config_map = f"{name}-specs"
    metadata: dict[str, Any] = {"name": name}
    if settings.namespace:
        metadata["namespace"] = settings.namespace
    labels = {"app.kubernetes.io/name": "headroom", "app.kubernetes.io/instance": name}
    args = trainer_args(
        plan, steps=steps, device=device, specs=SPECS_DIR, report=WORK_DIR / "report.json"
    )
    if nodes * settings.ranks_per_node == 1:
        # one rank: the trainer itself, so its exit code (3: out of memory) is the pod's
        command = ["python", "-m", "headroom", "train", *args]
    else:
        # torchrun takes the nodes, ranks, node rank and master from the operator's PET_*
        command = ["python", "-m", "torch.distributed.run", "-m", "headroom", "train", *args]
    env = []
    if plan.train.expandable_segments:
        env.append({"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"})
    resources: dict[str, Any] = {
        "requests": {
            "cpu": str(settings.ranks_per_node),
            "memory": _mebibytes(host_memory_bytes(plan, device, settings.ranks_per_node)),
        }
    }
    if settings.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": str(settings.gpus_per_node)}
    # Never: the trainer's exit ends its pod (exit 3, out of memory, is not retried)
    replicas = {
        kind: {
            "replicas": count,
            "restartPolicy": "Never",
            "template": _pod_template(settings.image, labels, command, env, resources, config_map),
        }
        for kind, count in (("Master", 1), ("Worker", nodes - 1))
        if count
    }
    specs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**metadata, "name": config_map, "labels": labels},
        "data": {
            name: json.dumps(document, indent=2) + "\n"
            for name, document in spec_documents(plan).items()
        },
    }
    job = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {**metadata, "labels": labels},
        "spec": {
            "nprocPerNode": str(settings.ranks_per_node),
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }
    return [specs, job]


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, writing multi-line strings (the specs' JSON) as literal blocks and
    a value met twice in full each time (no anchors and aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render_yaml(documents: Sequence[dict[str, Any]]) -> str:
    """``documents`` as one YAML stream (``---`` between them), keys in the order given."""
    text: str = yaml.dump_all(
        documents,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        explicit_start=True,
        width=100,
        allow_unicode=True,
    )
    return text
