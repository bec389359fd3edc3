"""No test runs past its limit: pytest-timeout fails it naming it, with every thread's stack,
and a test stuck where its signal cannot reach is stopped by the watchdog
(``tests/time_limits.py``). Each case runs a pytest of its own on a test file made here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SLOW = """
import threading, time
import pytest

@pytest.mark.timeout(2)
def test_sleeps_past_its_limit():
    threading.Thread(target=time.sleep, args=(60,), name="helper-thread", daemon=True).start()
    time.sleep(60)

def test_after_it_runs():
    pass
"""

DEAF = """
import signal, time
import pytest

@pytest.mark.timeout(1)
def test_blocks_the_alarm():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
"""


def _pytest(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess[str], float]:
    test = tmp_path / "test_case.py"
    test.write_text(source)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests"),
        "HEADROOM_TEST_HARD_STOP_GRACE_S": "2",
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "time_limits", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", str(test)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    return done, time.monotonic() - started


def test_a_test_past_its_limit_fails_by_name_with_every_threads_stack(tmp_path: Path) -> None:
    done, seconds = _pytest(tmp_path, SLOW)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "FAILED test_case.py::test_sleeps_past_its_limit - Failed: Timeout" in out
    assert "Stack of helper-thread" in out  # the other threads' stacks
    assert "1 failed, 1 passed" in out  # the run goes on
    assert seconds < 60


def test_a_test_the_alarm_cannot_reach_is_stopped_by_the_watchdog(tmp_path: Path) -> None:
    done, seconds = _pytest(tmp_path, DEAF)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "test_case.py::test_blocks_the_alarm ran 2 s past its 1 s limit" in done.stderr
    assert "Most recent call first" in done.stderr or "File " in done.stderr  # the stacks
    assert "test_blocks_the_alarm" in done.stderr
    assert seconds < 30
