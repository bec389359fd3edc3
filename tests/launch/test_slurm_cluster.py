"""The Slurm test cluster never outlives its test run (``tests/slurm_cluster``): a test process
SIGKILLed while its cluster runs a job leaves nothing running (daemons, job step, job), and a
cluster an earlier run left behind, daemonized as clusters were before they were bound to the
test process, is found at start, its jobs cancelled and its processes killed, while a live
run's cluster is left alone.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import processes
import pytest
import slurm_cluster

TESTS = Path(__file__).resolve().parents[1]
WAIT_S = 60.0


def _sleeping_job(env: dict[str, str], root: Path) -> int:
    """Submit a job that sleeps for ten minutes; once it runs, the pid of its sleep."""
    pid_file = root / "job.pid"
    subprocess.run(
        [
            "sbatch",
            f"--output={root / 'job.out'}",
            "--wrap",
            f"echo $$ > {pid_file}; exec sleep 600",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    deadline = time.monotonic() + WAIT_S
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.1)
    return int(pid_file.read_text())


def test_a_sigkilled_test_process_leaves_no_cluster_running(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # a short folder: a job step's socket lives under it (an xdist worker's tmp_path is deeper)
    root = tmp_path_factory.mktemp(f"{slurm_cluster.ROOT_PREFIX}-killed")
    code = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        import processes, slurm_cluster
        from test_slurm_cluster import _sleeping_job
        root = Path({str(root)!r})
        with slurm_cluster.one_node_cluster(root) as env:
            job = _sleeping_job(env, root)
            pids = processes.marked("SLURM_CONF", env["SLURM_CONF"])
            print(json.dumps({{"job": job, "pids": pids}}), flush=True)
            time.sleep(600)
    """)
    parent = processes.popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{TESTS}:{TESTS / 'launch'}"},
    )
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the cluster never ran the job"
        started = json.loads(parent.stdout.readline())
        cluster = [started["job"], *started["pids"]]
        # munged, slurmctld, slurmd and the job's step
        assert len(started["pids"]) >= 4 and all(processes.running(p) for p in cluster)
        parent.kill()  # SIGKILL: no cleanup runs in it
        parent.wait(timeout=10)
        assert processes.wait_gone(cluster, 10) == []
        assert str(root / "slurm.conf") not in slurm_cluster.stop_stale()  # nothing was left
    finally:
        processes.stop(parent)


def test_a_cluster_an_earlier_run_left_is_stopped_but_not_a_live_runs(
    cluster: dict[str, str],
) -> None:
    """Daemonized and unmarked, as test runs started clusters before their daemons were bound:
    while the pytest whose temporary directory holds it runs (its ``.lock`` names a live
    process, here this one) it is left alone; once that pytest is dead ``stop_stale`` finds it
    by its slurm.conf, cancels its job and kills all of it. The session's own cluster, whose
    owner is alive, still answers."""
    basetemp = Path(tempfile.mkdtemp(prefix="headroom-stale-")) / "pytest-1"
    root = basetemp / f"{slurm_cluster.ROOT_PREFIX}0"
    conf = slurm_cluster._conf(root, socket.gethostname().split(".")[0], 1)
    (basetemp / ".lock").write_text(str(os.getpid()))
    env = {**processes.unmarked(os.environ), "SLURM_CONF": str(conf)}
    try:
        daemons = [slurm_cluster.munge_command(root, foreground=False)]
        daemons += [["/usr/sbin/slurmctld"], ["/usr/sbin/slurmd"]]
        for daemon in daemons:  # daemonized: orphans
            subprocess.run(daemon, env=env, check=True, timeout=30)
        job = _sleeping_job(env, root)
        left = processes.marked("SLURM_CONF", str(conf))
        assert job in left and len(left) >= 5  # munged, slurmctld, slurmd, slurmstepd, the job
        assert str(conf) not in slurm_cluster.stop_stale()  # its pytest runs
        assert all(processes.running(p) for p in left)
        exited = subprocess.Popen(["true"])
        exited.wait(timeout=30)  # its pid now names no process: the pytest was killed
        (basetemp / ".lock").write_text(str(exited.pid))
        assert str(conf) in slurm_cluster.stop_stale()
        assert processes.wait_gone(left, 10) == []
        assert cluster["SLURM_CONF"] not in slurm_cluster.stop_stale()
        idle = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=cluster, capture_output=True, text=True, timeout=30
        )
        assert idle.stdout.strip() == "idle", idle
    finally:
        slurm_cluster._end(str(conf))
        shutil.rmtree(basetemp.parent)


def test_a_cluster_too_deep_for_its_job_sockets_is_refused_before_it_starts(tmp_path: Path) -> None:
    """Past 107 bytes slurmstepd cannot bind a job step's socket and every job is requeued and
    held: the cluster refuses such a folder, naming it, instead of a job that never runs."""
    root = tmp_path / ("d" * 120)
    with (
        pytest.raises(ValueError, match="too deep for its job sockets"),
        slurm_cluster.one_node_cluster(root),
    ):
        pass


def test_a_cluster_authenticates_with_a_munged_of_its_own(cluster: dict[str, str]) -> None:
    """A munged another run left on the machine's socket (one a CI step's PID namespace cannot
    see, as once happened) has nothing to do with the cluster: slurm.conf names the cluster's
    own socket, served by a munged bound to the cluster, whose key only root reads."""
    conf = Path(cluster["SLURM_CONF"])
    root = conf.parent
    socket_path = slurm_cluster.munge_socket(root)
    assert f"AuthInfo=socket={socket_path}" in conf.read_text().splitlines()
    ours = [
        pid
        for pid in processes.marked("SLURM_CONF", str(conf))
        if Path(f"/proc/{pid}/exe").resolve().name == "munged"
    ]
    assert len(ours) == 1
    assert f"--socket={socket_path}" in Path(f"/proc/{ours[0]}/cmdline").read_text().split("\0")
    assert (root / "munge.key").stat().st_mode & 0o077 == 0
    credential = subprocess.run(
        ["munge", "--no-input", f"--socket={socket_path}"],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    decoded = subprocess.run(
        ["unmunge", f"--socket={socket_path}"],
        input=credential,
        capture_output=True,
        timeout=30,
    )
    assert decoded.returncode == 0 and b"STATUS:          Success (0)" in decoded.stdout
