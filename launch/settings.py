"""Where launched runs go, how many run at once and how long their directories are kept:
``HEADROOM_*`` environment variables.

``LaunchSettings`` extends the store's (``HEADROOM_DATABASE_URL``) with what a ``Supervisor``
reads (where runs go, where they train, how many at once, how long their directories stay);
the service's ``Settings`` extends it in turn, and ``headroom launch`` uses it directly, so
launching from the command line needs no web stack. ``ClusterShape`` is one launch's shape on
a cluster, and ``SlurmTime`` a Slurm time limit.

Every count here is an integer as the planner's are (``planner._numbers``): a boolean is
refused naming the field (``nodes: true`` was one node), a whole number written ``2.0`` is 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings

from headroom.planner import SpecError
from headroom.planner._numbers import INTEGER, Int
from headroom.store import StoreSettings

S = TypeVar("S", bound=BaseSettings)

#: Slurm's forms of a time limit (sbatch --time): minutes, minutes:seconds,
#: hours:minutes:seconds, days-hours, days-hours:minutes and days-hours:minutes:seconds
SLURM_TIME_PATTERN = (
    r"^(?:[0-9]{1,9}-[0-9]{1,9}(?::[0-9]{1,9}){0,2}|[0-9]{1,9}(?::[0-9]{1,9}){0,2})$"
)
SLURM_TIME_FORMS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (D days, H hours, M minutes, S seconds)"
#: the longest time limit a run may ask for
MAX_SLURM_TIME_DAYS = 365


def slurm_seconds(text: str) -> int:
    """The seconds a Slurm time limit in one of its forms (``SLURM_TIME_PATTERN``) stands for."""
    days, dash, clock = text.partition("-")
    parts = [int(p) for p in (clock if dash else text).split(":")]
    if dash:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
    elif len(parts) == 3:  # hours:minutes:seconds
        hours, minutes, seconds = parts
    else:  # minutes[:seconds]
        hours, minutes, seconds = 0, parts[0], [*parts, 0][1]
    return (((int(days) if dash else 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _a_limit(text: str) -> str:
    if not re.fullmatch(SLURM_TIME_PATTERN, text):
        why = "not a Slurm time limit"
    elif slurm_seconds(text) < 60:
        why = "under a minute (0 is no limit)"  # Slurm reads 0 (and -1, UNLIMITED) as none
    elif slurm_seconds(text) > MAX_SLURM_TIME_DAYS * 86400:
        why = f"over {MAX_SLURM_TIME_DAYS} days"
    else:
        return text
    allowed = f"1 minute to {MAX_SLURM_TIME_DAYS} days as {SLURM_TIME_FORMS}"
    raise ValueError(f"{text[:16]!r} is {why}; allowed: {allowed}")


#: a Slurm time limit (sbatch --time) of 1 minute to ``MAX_SLURM_TIME_DAYS`` days, in one of
#: Slurm's forms (a message naming them when not; the pattern is the schema's)
SlurmTime = Annotated[
    str,
    Field(max_length=32, json_schema_extra={"pattern": SLURM_TIME_PATTERN}),
    AfterValidator(_a_limit),
]


class ClusterShape(BaseModel):
    """One launch's own shape on a cluster (Slurm's allocation, a Kubernetes job), over the
    backend's ``HEADROOM_*`` settings: None keeps the setting's."""

    model_config = ConfigDict(extra="forbid")

    gpus_per_node: Annotated[int, Field(ge=0, le=64), INTEGER] | None = Field(
        default=None, description="GPUs per node."
    )
    nodes: Int = Field(default=1, ge=1, le=1024, description="Nodes the job runs on.")

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
    max_running: Int = Field(
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
