"""Where launched runs go, how many run at once and how long their directories are kept:
``HEADROOM_*`` environment variables.

``LaunchSettings`` extends the store's (``HEADROOM_DATABASE_URL``) with what a ``Supervisor``
reads (where runs go, where they train, how many at once, how long their directories stay);
the service's ``Settings`` extends it in turn, and ``headroom launch`` uses it directly, so
launching from the command line needs no web stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings

from headroom.planner import SpecError
from headroom.store import StoreSettings

S = TypeVar("S", bound=BaseSettings)


class ClusterShape(BaseModel):
    """One launch's own shape on a cluster (Slurm's allocation, a Kubernetes job), over the
    backend's ``HEADROOM_*`` settings: None keeps the setting's."""

    model_config = ConfigDict(extra="forbid")

    gpus_per_node: int | None = Field(default=None, ge=0, le=64, description="GPUs per node.")
    nodes: int = Field(default=1, ge=1, le=1024, description="Nodes the job runs on.")

    def applied(self, settings: S) -> S:
        """``settings`` with this launch's values over them (the node count is the job's)."""
        values = self.model_dump(exclude_none=True, exclude={"nodes"})
        return settings.model_copy(update=values)


def ranks_per_node(data_parallel: int, nodes: int) -> int:
    """The trainer's ranks on each of a job's ``nodes``: ``parallel.dp`` split evenly (a
    ``SpecError`` naming ``parallel.dp`` where it cannot be)."""
    if data_parallel % nodes:
        raise SpecError(
            f"parallel.dp: {data_parallel} ranks do not split evenly over {nodes} nodes; allowed: "
            f"a multiple of {nodes}",
            field="parallel.dp",
        )
    return data_parallel // nodes


def from_environment(cls: type[S]) -> S:
    """``cls()`` read from its environment variables; an invalid one is a ``SpecError`` naming
    the variable (``HEADROOM_SLURM_TIME_LIMIT``, not the field) and what it held."""
    try:
        return cls()
    except ValidationError as exc:
        first = exc.errors()[0]
        name = f"{cls.model_config.get('env_prefix', '')}{first['loc'][0]}".upper()
        raise SpecError(f"{name}: {first['msg']}, got {first.get('input')!r}", field=name) from None


class LaunchSettings(StoreSettings):
    """The store's settings and the launch layer's (prefix ``HEADROOM_``)."""

    run_dir: Path = Field(default=Path("runs"), description="Where launched runs keep their logs.")
    run_device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where launched runs train (auto: cuda when NVML sees one)."
    )
    max_running: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Runs trained at a time: by one service process, and by all the service's "
        "replicas on one database together.",
    )
    reconcile_every_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds between two looks for runs a stopped service (a replica) left "
        "running.",
    )
    owner_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description="Seconds without a heartbeat after which a supervisor on another host counts "
        "as gone: its Slurm jobs are taken over by a replica here (supervisors beat every "
        "third of it).",
    )
    run_retention_days: float | None = Field(
        default=None,
        gt=0,
        description="Days after a run ended until its directory (log, specs, report) is "
        "removed; the run's record stays. Unset: run directories are kept.",
    )
