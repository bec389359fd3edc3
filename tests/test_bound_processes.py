"""``tests/processes``: what a test starts is bounded in time and cannot outlive the test
process, not when the test fails or times out, not when the test process is SIGKILLed; nor can
what it started in turn, in a session of its own or as a daemon.

Each case's "test process" is a small Python parent, itself started through the helper, that
starts something and is then killed outright (SIGKILL: nothing runs in it afterwards).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import processes
import pytest

TESTS = Path(__file__).resolve().parent
#: a Python child that starts ``sleep 600`` in a session of its own (out of its process group,
#: as torchrun's ranks and a served supervisor's trainers are), prints its pid and waits
ESCAPES = (
    "import subprocess, time; "
    "p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
    "print(p.pid, flush=True); time.sleep(600)"
)


def _line(proc: subprocess.Popen[bytes], timeout: float = 60) -> bytes:
    """The next line ``proc`` prints, within ``timeout``: a parent that hangs fails the test."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"nothing printed within {timeout} s"
    return proc.stdout.readline()


def _parent(body: str) -> subprocess.Popen[bytes]:
    """A parent Python that runs ``body`` (which prints a pid) and then waits to be killed."""
    code = f"import processes, subprocess, sys, time\n{textwrap.dedent(body)}\ntime.sleep(600)\n"
    return processes.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=TESTS)


def _sigkill(parent: subprocess.Popen[bytes]) -> None:
    """Kill the parent outright and reap it; ``processes.stop``, which would kill what carries
    its tag, the processes under test too, is left for after the assertions."""
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)


def test_a_child_dies_with_its_sigkilled_test_process() -> None:
    parent = _parent("print(processes.popen(['sleep', '600']).pid, flush=True)")
    try:
        child = int(_line(parent))
        assert processes.running(child)
        _sigkill(parent)
        assert processes.wait_gone([child], 5) == []
    finally:
        processes.stop(parent)


def test_a_daemon_the_test_process_started_any_way_dies_with_it() -> None:
    """Started with plain ``subprocess``, not the helper, double-forked into a session of its
    own and orphaned (as slurmctld daemonizes): the watchdog of the guarded parent kills it."""
    parent = _parent("""
        processes.guard()
        shell = subprocess.run(
            ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
            capture_output=True, text=True, timeout=30, start_new_session=True,
        )
        print(shell.stdout.strip(), flush=True)
    """)
    try:
        daemon = int(_line(parent))
        assert processes.running(daemon)
        assert processes._environ(daemon)[processes.OWNER_VAR] != os.environ[processes.OWNER_VAR]
        _sigkill(parent)
        assert processes.wait_gone([daemon], 10) == []
    finally:
        processes.stop(parent)


def test_stop_ends_what_the_child_started_outside_its_group() -> None:
    with processes.started([sys.executable, "-c", ESCAPES], stdout=subprocess.PIPE) as child:
        escaped = int(_line(child))
        assert os.getsid(escaped) != os.getsid(child.pid)
    assert child.returncode == -signal.SIGTERM
    assert processes.wait_gone([escaped], 5) == []


def test_run_kills_the_whole_tree_at_its_timeout() -> None:
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        processes.run([sys.executable, "-c", ESCAPES], timeout=3)
    assert time.monotonic() - began < 3 + 5
    escaped = int(str(raised.value.stdout))  # what it printed before its timeout
    assert processes.wait_gone([escaped], 5) == []


def test_run_is_subprocess_run_with_its_output() -> None:
    done = processes.run(
        [sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.exit(3)"],
        timeout=60,
        input="piped",
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "PIPED\n", "")


def test_guard_kills_what_a_dead_owner_left_and_only_that() -> None:
    """An earlier run killed along with its watchdog left a process: the next guard ends it;
    a live run's process (here, this one's) is left alone."""
    owner = subprocess.Popen(["sleep", "600"])
    dead = processes.identity(owner.pid)
    owner.kill()
    owner.wait(timeout=10)
    assert not processes.alive(dead) and processes.alive(processes.guard())
    env = processes.unmarked(os.environ)
    left = subprocess.Popen(["sleep", "600"], env={**env, processes.OWNER_VAR: dead})
    kept = subprocess.Popen(["sleep", "600"], env={**env, processes.OWNER_VAR: processes.guard()})
    try:
        deadline = time.monotonic() + 10
        while not all(processes._environ(p.pid).get(processes.OWNER_VAR) for p in (left, kept)):
            assert time.monotonic() < deadline, "not started"  # until both have exec'd
            time.sleep(0.05)
        assert left.pid in processes.sweep_stale()
        assert left.wait(timeout=5) == -signal.SIGKILL
        assert kept.poll() is None
    finally:
        for proc in (left, kept):
            proc.kill()
            proc.wait(timeout=10)
