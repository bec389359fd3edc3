"""A one-node Slurm cluster for the tests: MUNGE, ``slurmctld`` and ``slurmd`` from Debian's
packages (``scripts/install-slurm.sh``, run by ``make test``), started with a generated
``slurm.conf`` in a temporary directory on free ports, stopped at the end. The node is this
machine with its CPUs; there is no accounting (``sacct`` knows nothing), as on many small
clusters."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
START_TIMEOUT_S = 30.0


def missing() -> list[str]:
    """The daemons this machine lacks (``scripts/install-slurm.sh`` installs them)."""
    return [d for d in DAEMONS if not Path(d).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _munge() -> None:
    """A running munged (its key comes with the package)."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    run = Path("/run/munge")
    run.mkdir(parents=True, exist_ok=True)
    shutil.chown(run, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)


def _conf(root: Path, node: str, cpus: int) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=headroom-test",
                f"SlurmctldHost={node}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MinJobAge=300",
                f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
                "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


def _kill(pid_file: Path) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        os.kill(int(pid_file.read_text().strip()), 15)


@contextlib.contextmanager
def one_node_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start a cluster under ``root``; yields the environment its commands need
    (``SLURM_CONF``)."""
    node = socket.gethostname().split(".")[0]
    conf = _conf(root, node, os.cpu_count() or 1)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    _munge()
    subprocess.run(["/usr/sbin/slurmctld"], env=env, check=True)
    subprocess.run(["/usr/sbin/slurmd"], env=env, check=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
            )
            state = out.stdout.strip()
            if state == "idle":
                break
            time.sleep(0.2)
        else:
            log = (root / "log" / "slurmctld.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the test cluster's node is {state!r}, not idle: {log}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        time.sleep(0.5)
        _kill(root / "run" / "slurmd.pid")
        _kill(root / "run" / "slurmctld.pid")
