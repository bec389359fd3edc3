"""Slurm: a plan becomes a batch job, and the job's state comes back from the controller.

``batch_script`` renders the job: the allocation (nodes, GPUs per node, time limit, partition,
account; defaults from ``HEADROOM_SLURM_*``, each overridable per launch), the trainer's log in
the run directory, and one ``srun`` task per node starting ``torchrun`` with a rendezvous on the
first node, so the trainer runs as ``nodes x ranks per node`` processes. ``submit`` hands it
to ``sbatch``; ``job_state`` reads the job back from ``scontrol`` (``sacct`` once the controller
has forgotten it, where accounting exists); ``cancel`` is ``scancel``; ``ending`` turns a
finished job into a run's ending: the trainer's exit code (3: out of memory) or the signal that
ended it, a cancellation, a time limit or a node failure.

The commands run with the caller's environment (``SLURM_CONF`` points at a cluster); nothing
goes through a shell but the batch script itself, whose every argument is quoted.

``headroom launch --backend slurm`` and ``POST /runs`` with ``backend: slurm`` submit through
here (``launch.supervisor``): a run with ``probe`` is probed inside its job, on the node that
trains it, before its trainer starts (``launch.probe_process``); the run keeps its job id, the
supervisor watches the job through the controller, a restarted supervisor takes the jobs of
runs it finds running over, and the trainer's log is the job's output in the run directory
(which the cluster's nodes must see at the same path, as they must see this interpreter).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from headroom.launch.backends import EXIT_OOM, describe_exit
from headroom.launch.settings import ClusterShape, SlurmTime
from headroom.planner._numbers import Int

#: seconds a Slurm command may take before the controller counts as unreachable
COMMAND_TIMEOUT_S = 30.0
#: the rendezvous port on a job's first node
RDZV_PORT = 29500
#: what a partition or account name may hold (Slurm's names; nothing a shell would read)
SAFE = r"^[A-Za-z0-9_.,+-]+$"


class SlurmSettings(BaseSettings):
    """Where and how runs are submitted (``HEADROOM_SLURM_*``; each overridable per launch)."""

    model_config = SettingsConfigDict(env_prefix="HEADROOM_SLURM_", extra="ignore")

    partition: str | None = Field(default=None, description="sbatch --partition.")
    account: str | None = Field(default=None, description="sbatch --account.")
    time_limit: SlurmTime = Field(
        default="01:00:00", description="sbatch --time (Slurm's format; at least a minute)."
    )
    gpus_per_node: Int = Field(default=0, ge=0, le=64, description="GPUs each node is given.")
    ranks_per_node: Int = Field(
        default=1,
        ge=1,
        le=256,
        description="Trainer processes per node (torchrun's); a run's is its parallel.dp over "
        "its nodes.",
    )


class SlurmOverrides(ClusterShape):
    """One launch's own allocation, over ``SlurmSettings``' (None: the setting's)."""

    partition: str | None = Field(
        default=None, min_length=1, max_length=200, pattern=SAFE, description="sbatch --partition."
    )
    account: str | None = Field(
        default=None, min_length=1, max_length=200, pattern=SAFE, description="sbatch --account."
    )
    time_limit: SlurmTime | None = Field(
        default=None, description="sbatch --time (Slurm's format; at least a minute)."
    )


class SlurmError(RuntimeError):
    """A Slurm command failed: the controller is unreachable or refused the request."""


class JobState(NamedTuple):
    """What the controller says of one job."""

    state: str  # Slurm's JobState: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...
    exit_code: int  # the batch script's exit code
    signal: int  # the signal that ended it (0: none)
    reason: str  # Slurm's Reason


#: states in which a job has ended
ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def batch_script(
    trainer_args: Sequence[str],
    *,
    job_name: str,
    log: Path,
    nodes: int,
    settings: SlurmSettings,
    python: str,
    chdir: Path | None = None,
    first: Sequence[str] | None = None,
) -> str:
    """The batch script that runs ``headroom train trainer_args`` on ``nodes`` nodes of
    ``settings.ranks_per_node`` ranks each (in ``chdir``, where given); ``first``, a command
    the job runs on its first node before the trainer (the run's probes), ends the job with
    its exit code if it fails."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(job_name)}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={settings.ranks_per_node}",
        f"#SBATCH --time={settings.time_limit}",
        f"#SBATCH --output={shlex.quote(str(log))}",
    ]
    if chdir is not None:
        lines.append(f"#SBATCH --chdir={shlex.quote(str(chdir))}")
    if settings.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={settings.gpus_per_node}")
    if settings.partition:
        lines.append(f"#SBATCH --partition={shlex.quote(settings.partition)}")
    if settings.account:
        lines.append(f"#SBATCH --account={shlex.quote(settings.account)}")
    train = ["-m", "headroom", "train", *trainer_args]
    if nodes * settings.ranks_per_node == 1:
        # one rank: the trainer itself, so its exit code (3: out of memory) is the job's
        command = shlex.join([python, *train])
    else:
        # torchrun per node, rendezvous on the first (torchrun reports any rank's failure as
        # its own exit 1)
        torchrun = [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--nproc-per-node",
            str(settings.ranks_per_node),
            "--rdzv-backend",
            "c10d",
        ]
        endpoint = f'--rdzv-endpoint "$head:{RDZV_PORT}"'
        command = f"{shlex.join(torchrun)} {endpoint} {shlex.join(train)}"
    lines += [
        "set -euo pipefail",
        "umask 077",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        *([shlex.join(first)] if first else []),
        # srun returns the largest exit code of its tasks: the job's
        f"exec srun --kill-on-bad-exit=1 {command}",
    ]
    return "\n".join(lines) + "\n"


def _run(argv: Sequence[str], env: Mapping[str, str] | None) -> str:
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{argv[0]}: {exc}") from None
    if proc.returncode != 0:
        raise SlurmError(f"{argv[0]} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc.stdout


def submit(script: Path, env: Mapping[str, str] | None = None) -> str:
    """Submit ``script``; the job id. Slurm creates the job's output file (the run's log)
    before the script's ``umask 077`` runs, with ``SLURM_UMASK``: 077 here, so it is 0600."""
    env = {**(os.environ if env is None else env), "SLURM_UMASK": "0077"}
    out = _run(["sbatch", "--parsable", str(script)], env).strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch: no job id in {out!r}")
    return job_id


def _fields(text: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as a dict (values may hold no spaces but Reason's
    and Command's ends, which we do not read)."""
    out = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def _exit_code(text: str) -> tuple[int, int]:
    code, _, sig = text.partition(":")
    return int(code or 0), int(sig or 0)


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> JobState | None:
    """The controller's view of ``job_id`` (None: it knows no such job any more and no
    accounting remembers it)."""
    try:
        fields = _fields(_run(["scontrol", "show", "job", "-o", job_id], env))
    except SlurmError as exc:
        if "Invalid job id" not in str(exc):
            raise
        return _accounted(job_id, env)
    code, sig = _exit_code(fields.get("ExitCode", "0:0"))
    return JobState(fields.get("JobState", "UNKNOWN"), code, sig, fields.get("Reason", ""))


def _accounted(job_id: str, env: Mapping[str, str] | None) -> JobState | None:
    """``sacct``'s record of a job the controller has forgotten (None without accounting)."""
    try:
        out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Reason"], env)
    except SlurmError:
        return None
    for line in out.splitlines():
        state, exit_code, reason = [*line.split("|"), "", "", ""][:3]
        if state:
            code, sig = _exit_code(exit_code)
            return JobState(state.split()[0], code, sig, reason)
    return None


def cancel(job_id: str, env: Mapping[str, str] | None = None) -> None:
    """Cancel ``job_id`` (``scancel``: SIGTERM to its steps, then SIGKILL)."""
    _run(["scancel", job_id], env)


def ending(job: JobState) -> tuple[str, str]:
    """(run status, reason) of a job that has ended: succeeded, cancelled or failed with why."""
    if job.state == "COMPLETED":
        return "succeeded", "completed"
    if job.state == "CANCELLED":
        return "cancelled", "cancelled (scancel)"
    if job.state == "TIMEOUT":
        return "failed", "time limit reached"
    if job.state == "NODE_FAIL":
        return "failed", "node failure"
    if job.state == "OUT_OF_MEMORY":
        return "failed", "out of memory (Slurm's memory limit)"
    if job.signal:
        return "failed", describe_exit(-job.signal)
    if job.exit_code == EXIT_OOM:
        return "failed", describe_exit(EXIT_OOM)
    return "failed", f"{job.state.lower()}: {describe_exit(job.exit_code)}"
