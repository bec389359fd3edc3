"""A one-node Slurm cluster for the tests: MUNGE, ``slurmctld`` and ``slurmd`` from Debian's
packages (``scripts/install-slurm.sh``, run by ``make test``), started with a generated
``slurm.conf`` in a temporary directory on free ports, stopped at the end. The node is this
machine with its CPUs; there is no accounting (``sacct`` knows nothing), as on many small
clusters.

Each cluster has its own MUNGE: a munged with its own key and socket (slurm.conf's
``AuthInfo``), as the cluster's daemons are its own. Nothing is shared with the machine's munged
or another run's: a munged another run (or another PID namespace) left holding
``/run/munge``'s socket cannot stop this one starting.

Nothing of a cluster outlives its test run. The daemons run in the foreground (``-D``) as bound
children of the test process (``tests/processes.py``): they die with it, even when it is
SIGKILLed, where daemonized ones would keep running, jobs and all. A job's processes are not
the daemons' children once slurmstepd detaches, so at the end every process whose
``SLURM_CONF`` is the cluster's is killed too. And at start, the clusters an earlier run left
behind (a test cluster's ``slurm.conf``, no live owner) have their jobs cancelled and their
processes killed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import processes

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
START_TIMEOUT_S = 30.0
#: the bound on each Slurm command (sinfo, scancel, scontrol) and on munged's start
COMMAND_TIMEOUT_S = 30.0
#: a Unix socket's longest path (sun_path is 108 bytes with its terminating NUL)
MAX_SOCKET_PATH = 107
#: the first line of every test cluster's slurm.conf: how a cluster left running is recognised
CLUSTER_NAME = "headroom-test"
#: how the fixture names a cluster's directory (``tmp_path_factory.mktemp``): how a cluster
#: left running is recognised once its slurm.conf is gone
ROOT_PREFIX = "headroom-slurm"


def missing() -> list[str]:
    """The daemons this machine lacks (``scripts/install-slurm.sh`` installs them)."""
    return [d for d in DAEMONS if not Path(d).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _munge_key(root: Path) -> Path:
    """A key of the cluster's own: 1,024 random bytes only root reads (as ``mungekey``
    writes one)."""
    key = root / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    return key


def munge_command(root: Path, foreground: bool = True) -> list[str]:
    """munged for the cluster under ``root`` alone: its own key, socket, pid, seed and log
    files, in the foreground unless told. ``--force`` lets it run as root and on a socket in a
    folder others cannot enter (pytest's are 0700): every job here runs as root."""
    return [
        "/usr/sbin/munged",
        *(["--foreground"] if foreground else []),
        "--force",
        f"--socket={munge_socket(root)}",
        f"--key-file={_munge_key(root)}",
        f"--pid-file={root / 'run' / 'munged.pid'}",
        f"--seed-file={root / 'state' / 'munged.seed'}",
        f"--log-file={root / 'log' / 'munged.log'}",
    ]


def munge_socket(root: Path) -> Path:
    """The socket of the cluster's own munged (slurm.conf's ``AuthInfo`` names it)."""
    return root / "run" / "munge.socket"


def _wait_munge(root: Path, munged: subprocess.Popen[Any]) -> None:
    """Wait until the cluster's munged encodes a credential: one that exits, or is not ready
    within ``START_TIMEOUT_S``, fails with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and munged.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            probe = ["munge", "--no-input", f"--socket={munge_socket(root)}"]
            ready = subprocess.run(probe, capture_output=True, timeout=COMMAND_TIMEOUT_S)
            if ready.returncode == 0:
                return
        time.sleep(0.1)
    log = root / "log" / "munged.log"
    text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"the test cluster's munged is not ready (exit: {munged.poll()}): {text}")


def _conf(root: Path, node: str, cpus: int) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                f"ClusterName={CLUSTER_NAME}",
                f"SlurmctldHost={node}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                # the cluster's own munged: nothing is shared with the machine's or another run's
                f"AuthInfo=socket={munge_socket(root)}",
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


def _ours(conf: str) -> bool:
    """Whether ``conf`` is a test cluster's slurm.conf: its first line names the test cluster
    (while the file exists), or it lies in a directory named as the fixture names them."""
    path = Path(conf)
    try:
        with path.open() as f:
            return f.readline().strip() == f"ClusterName={CLUSTER_NAME}"
    except OSError:
        return path.name == "slurm.conf" and path.parent.name.startswith(ROOT_PREFIX)


def _end(conf: str) -> None:
    """Cancel the jobs of the cluster of ``conf``, shut its daemons down, then kill whatever
    is left of it: daemons, job steps and jobs, each carrying ``SLURM_CONF`` (a job inherits
    it from the environment it was submitted from)."""
    if Path(conf).exists():
        env = {**os.environ, "SLURM_CONF": conf}
        for command in (["scancel", "--full", "-u", "root"], ["scontrol", "shutdown"]):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(command, env=env, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    processes.kill_marked("SLURM_CONF", conf)


def _in_live_basetemp(conf: str) -> bool:
    """Whether ``conf`` lies in the temporary directory of a pytest process still running: its
    numbered base directory (``pytest-N``) holds a ``.lock`` naming that process until it
    exits, and a SIGKILLed pytest leaves the lock behind, naming a dead one. How a cluster
    started before the daemons carried an owner mark is told apart from a live run's."""
    for directory in Path(conf).parents:
        lock = directory / ".lock"
        with contextlib.suppress(OSError, ValueError):
            return processes.alive(processes.identity(int(lock.read_text().strip())))
    return False


def stop_stale() -> list[str]:
    """Stop the test clusters earlier runs left running (killed before they could stop them,
    or from before the daemons were bound to the test process): jobs cancelled, processes
    killed. A cluster with a process whose owner (``processes.owner_of``) is alive, or in the
    temporary directory of a pytest still running, belongs to a test run still going, and is
    left alone. The slurm.conf of each cluster stopped."""
    live: dict[str, bool] = {}
    for _, env in processes.environs():
        conf = env.get("SLURM_CONF", "")
        if conf and _ours(conf):
            owner = processes.owner_of(env)
            live[conf] = live.get(conf, False) or (owner is not None and processes.alive(owner))
    stale = [conf for conf, alive in live.items() if not alive and not _in_live_basetemp(conf)]
    for conf in stale:
        _end(conf)
    return stale


def _wait_idle(env: dict[str, str], root: Path, daemons: list[subprocess.Popen[Any]]) -> None:
    """Wait until the node is idle: a daemon that exits, or a node not idle within
    ``START_TIMEOUT_S``, fails with the controller's log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline and all(d.poll() is None for d in daemons):
        with contextlib.suppress(subprocess.TimeoutExpired):
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%T"],
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            state = out.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.2)
    exits = {Path(str(d.args[0])).name: d.returncode for d in daemons}
    logs = "".join(
        p.read_text(errors="replace")[-2000:]
        for p in sorted((root / "log").glob("*"))
        if p.is_file()
    )
    raise RuntimeError(f"the test cluster's node is {state!r}, not idle (exits: {exits}): {logs}")


@contextlib.contextmanager
def one_node_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start a cluster under ``root`` (after stopping any an earlier run left, ``stop_stale``);
    yields the environment its commands need (``SLURM_CONF``). At the end its jobs are
    cancelled and nothing of it is left running."""
    processes.guard()  # first: the environment yielded carries this run's mark
    stop_stale()
    node = socket.gethostname().split(".")[0]
    # slurmstepd's socket for a job step, spool/<node>_<job>.<step>, is a Unix socket: a path
    # past the kernel's 108 bytes fails every job launch ("launch failed requeued held")
    step_socket = root / "spool" / f"{node}_{2**32 - 1}.{2**32 - 5}"
    if len(os.fsencode(step_socket)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"a Slurm test cluster's folder is too deep for its job sockets: {step_socket} is "
            f"{len(os.fsencode(step_socket))} bytes, past {MAX_SOCKET_PATH}; use a shorter root"
        )
    conf = _conf(root, node, os.cpu_count() or 1)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    log = root / "log"
    try:
        with (
            (log / "munged.out").open("ab") as munge_out,
            (log / "slurmctld.out").open("ab") as ctld_out,
            (log / "slurmd.out").open("ab") as slurmd_out,
            processes.started(
                munge_command(root), env=env, stdout=munge_out, stderr=subprocess.STDOUT
            ) as munged,
        ):
            _wait_munge(root, munged)
            with (
                processes.started(
                    ["/usr/sbin/slurmctld", "-D"],
                    env=env,
                    stdout=ctld_out,
                    stderr=subprocess.STDOUT,
                ) as slurmctld,
                processes.started(
                    ["/usr/sbin/slurmd", "-D"], env=env, stdout=slurmd_out, stderr=subprocess.STDOUT
                ) as slurmd,
            ):
                try:
                    _wait_idle(env, root, [munged, slurmctld, slurmd])
                    yield env
                finally:
                    _end(str(conf))  # jobs cancelled while the daemons still run
    finally:
        processes.kill_marked("SLURM_CONF", str(conf))
