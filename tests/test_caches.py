"""A stopped run's half-written kernels never reach the next run (``tests/caches.py``): the
run that finds the mark of a run that is gone removes the compiled caches before any test
compiles; a live run's mark protects them; a run that ends by itself leaves no mark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import caches
import processes
import pytest

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = str(Path(__file__).with_name("sleeper.py"))


def _gone_owner() -> str:
    """The identity of a process that has exited."""
    exited = subprocess.Popen(["true"])
    identity = processes.identity(exited.pid)
    exited.wait(timeout=30)
    return identity


def _half_written(cache: Path) -> Path:
    """A kernel cut short as a stopped gcc leaves it (inductor then fails: file too short)."""
    kernel = cache / "inductor" / "qr" / "cqr4bdw2.main.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF")
    (cache / "triton").mkdir()
    return kernel


def test_a_stopped_runs_compiled_caches_are_removed(tmp_path: Path) -> None:
    kernel = _half_written(tmp_path)
    (tmp_path / "torch_extensions").mkdir()  # DeepSpeed's op: its own lock handling keeps it
    stale = tmp_path / f"{caches.MARK_PREFIX}{_gone_owner()}"
    stale.touch()
    mark, removed = caches.claim(tmp_path)
    assert removed == ["inductor", "triton"]
    assert not kernel.exists() and not stale.exists()
    assert (tmp_path / "torch_extensions").is_dir()
    assert mark.name == f"{caches.MARK_PREFIX}{processes.identity(os.getpid())}" and mark.exists()
    caches.release(mark)
    assert list(tmp_path.glob(f"{caches.MARK_PREFIX}*")) == []


def test_a_live_runs_caches_are_left_alone(tmp_path: Path) -> None:
    """Another run of this clone is still going: its kernels are in use, whatever a stopped
    run left beside them."""
    kernel = _half_written(tmp_path)
    (tmp_path / f"{caches.MARK_PREFIX}{_gone_owner()}").touch()
    live = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / f"{caches.MARK_PREFIX}{processes.identity(live.pid)}").touch()
        mark, removed = caches.claim(tmp_path)
        assert removed == [] and kernel.exists()
        caches.release(mark)
    finally:
        live.kill()
        live.wait(timeout=30)


def _pytest(cache: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HEADROOM_TEST_CACHE": str(cache)}
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return processes.popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE)


def test_a_suite_run_removes_what_a_killed_one_left_and_then_leaves_no_mark(
    tmp_path: Path,
) -> None:
    """Through pytest itself: a run SIGKILLed mid-test leaves its mark; the next finds it,
    removes the compiled caches, and, ending by itself, leaves no mark."""
    killed = _pytest(tmp_path, SLEEPER)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"{caches.MARK_PREFIX}*")):
            assert time.monotonic() < deadline and killed.poll() is None, "no run marked"
            time.sleep(0.1)
        kernel = _half_written(tmp_path)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        processes.stop(killed)
    assert len(list(tmp_path.glob(f"{caches.MARK_PREFIX}*"))) == 1
    following = _pytest(tmp_path, SLEEPER, "-k", "not sleeps")
    out, _ = following.communicate(timeout=120)
    assert following.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, out
    assert not kernel.exists() and not (tmp_path / "triton").exists()
    assert list(tmp_path.glob(f"{caches.MARK_PREFIX}*")) == []
