"""A cluster: how many GPUs of which kind share a node, and the links between them.

What the step-time model of a parallel layout reads (``planner.layout``): the GPU-to-GPU
bandwidth inside a node (NVLink through NVSwitch, or PCIe), each GPU's share of the network
between nodes (InfiniBand/RoCE: one NIC per GPU on DGX-class nodes), what a collective achieves
of them (NCCL's bus bandwidth over the link's nominal rate) and a per-step latency, and the host
RAM of a node. Presets are data files in ``planner/data/clusters/`` with their sources; a
cluster file with the same fields overrides them (``load_cluster``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from headroom.planner._keys import FewUnknownKeys, at_most
from headroom.planner._numbers import INTEGER, Float, Int
from headroom.planner.errors import InputFormatError, UnknownPresetError, did_you_mean
from headroom.planner.hardware import (
    MAX_GPUS_PER_NODE,
    MAX_HOST_MEMORY_BYTES,
    Hardware,
    gpu,
    unknown_gpu,
)
from headroom.planner.io import build, is_spec_file_name, read_file

_TEXT = r"^[^\x00]*$"


class Cluster(FewUnknownKeys):
    """Nodes of ``gpus_per_node`` GPUs and the links a parallel layout's collectives cross."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=100, pattern=_TEXT)
    aliases: Annotated[
        tuple[Annotated[str, Field(max_length=100, pattern=_TEXT)], ...],
        at_most(32, "aliases"),
    ] = ()
    gpu: str = Field(
        max_length=100,
        pattern=_TEXT,
        description="The GPU preset of its nodes (headroom presets); in a cluster file also a "
        "GPU file (.json/.yaml, relative to the cluster file), read into gpu_spec.",
    )
    gpu_spec: Hardware | None = Field(
        default=None,
        description="The GPU of its nodes when no preset has it (the Hardware fields; gpu is "
        "then its name).",
    )
    gpus_per_node: Int = Field(ge=1, le=MAX_GPUS_PER_NODE, description="GPUs of one node.")
    intra_node_bytes_per_s: Float = Field(
        ge=1, le=1e16, description="GPU-to-GPU bandwidth inside a node, per GPU, each way."
    )
    inter_node_bytes_per_s: Float = Field(
        ge=1, le=1e16, description="Each GPU's share of the network between nodes, each way."
    )
    intra_node_efficiency: Float = Field(
        default=0.8, gt=0, le=1, description="What a collective achieves of the intra-node link."
    )
    inter_node_efficiency: Float = Field(
        default=0.85, gt=0, le=1, description="What a collective achieves of the network."
    )
    intra_node_latency_s: Float = Field(
        default=5e-6, ge=0, le=1, description="Latency of one step of a collective in a node."
    )
    inter_node_latency_s: Float = Field(
        default=1e-5, ge=0, le=1, description="Latency of one step of a collective across nodes."
    )
    host_memory_bytes: Annotated[int, Field(ge=1, le=MAX_HOST_MEMORY_BYTES), INTEGER] | None = (
        Field(default=None, description="Host RAM of one node (None: not checked).")
    )
    source: str = Field(default="custom", max_length=4000, pattern=_TEXT)

    def hardware(self, hw: Hardware | None = None) -> Hardware:
        """The GPU of its nodes (its preset, or ``hw``) in this cluster's node: its GPUs share
        the node's host RAM."""
        if hw is None:
            hw = self.gpu_spec if self.gpu_spec is not None else cluster_gpu(self.gpu)
        update: dict[str, object] = {"gpus_per_node": self.gpus_per_node}
        if self.host_memory_bytes is not None:
            update["host_memory_bytes"] = self.host_memory_bytes
        return hw.model_copy(update=update)


def cluster_gpu(name: str, where: str = "") -> Hardware:
    """The GPU preset a cluster's ``gpu`` names; an unknown one is refused as the cluster's
    field (``where``: the file it came from)."""
    try:
        return gpu(name)
    except UnknownPresetError:
        source = f" (in {where})" if where else ""
        raise UnknownPresetError(
            f"cluster.gpu{source}: {unknown_gpu(name)}, or in a cluster file a GPU file "
            "(.json/.yaml, relative to the cluster file)",
            field="cluster.gpu",
        ) from None


@cache
def _presets() -> dict[str, Cluster]:
    found: dict[str, Cluster] = {}
    folder = resources.files("headroom.planner") / "data" / "clusters"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            cluster = Cluster(**json.loads(entry.read_text()))
            for key in (cluster.name, *cluster.aliases):
                found[key.lower()] = cluster
    return found


def cluster_names() -> list[str]:
    """Canonical names of the bundled cluster presets."""
    return sorted({c.name for c in _presets().values()})


def cluster_preset(name: str) -> Cluster:
    """A bundled cluster preset by name or alias (case-insensitive)."""
    found = _presets().get(name.strip().lower())
    if found is None:
        closest = did_you_mean(name, {alias: p.name for alias, p in _presets().items()})
        raise UnknownPresetError(
            f"cluster: unknown preset {name!r}{closest}; allowed: "
            f"{', '.join(cluster_names())} or a cluster file",
            field="cluster",
        )
    return found


def cluster_for_gpu(hw: Hardware) -> Cluster:
    """The bundled cluster whose nodes hold ``hw``'s GPU."""
    for c in sorted(set(_presets().values()), key=lambda c: c.name):
        if gpu(c.gpu).name == hw.name:
            return c
    with_gpus = ", ".join(f"{c} ({cluster_preset(c).gpu})" for c in cluster_names())
    raise UnknownPresetError(
        f"cluster: no cluster preset has {hw.name} GPUs; give a cluster file (--cluster) or one "
        f"of: {with_gpus}",
        field="cluster",
    )


def cluster_and_gpu(
    given: Cluster | None, hw: Hardware | None, gpus_per_node: int | None
) -> tuple[Cluster, Hardware]:
    """The cluster a plan runs on and its GPU in its node: ``given``, else the preset whose
    nodes hold ``hw`` (no GPU given: H100-80GB); ``gpus_per_node`` (held to its bounds by the
    caller) overrides its node's size; the GPU is ``hw``, else the cluster's preset."""
    cl = given if given is not None else cluster_for_gpu(hw if hw is not None else gpu("H100-80GB"))
    if gpus_per_node is not None:
        cl = cl.model_copy(update={"gpus_per_node": gpus_per_node})
    return cl, cl.hardware(hw)


def load_cluster(source: str | Path | Mapping[str, Any] | Cluster) -> Cluster:
    """A cluster preset's name, a JSON/YAML cluster file, or a dict of the cluster fields."""
    if isinstance(source, Cluster):
        return source
    if isinstance(source, Mapping):
        return build(Cluster, source, prefix="cluster")
    path = Path(source)
    if is_spec_file_name(path) or path.is_file():
        data = read_file(path)
        if not isinstance(data, dict):
            raise InputFormatError(
                f"cluster: {source} must hold an object of cluster fields", field="cluster"
            )
        named = data.get("gpu")
        if isinstance(named, str) and is_spec_file_name(named) and "gpu_spec" not in data:
            # a GPU file beside the cluster file: its Hardware becomes the nodes' GPU
            gpu_path = path.parent / named
            spec = build(Hardware, read_file(gpu_path), prefix=f"cluster.gpu ({gpu_path})")
            data = {**data, "gpu": spec.name, "gpu_spec": spec.model_dump()}
        cluster = build(Cluster, data, prefix="cluster")
        if cluster.gpu_spec is None:
            cluster_gpu(cluster.gpu, str(path))  # its GPU known now, not at the plan's end
        return cluster
    return cluster_preset(str(source))
