"""Every test's hard stop, behind pytest-timeout (a plugin: ``tests/conftest.py`` uses it, a
pytest of a test's own loads it with ``-p time_limits``).

pytest-timeout (``timeout`` in pyproject.toml, ``@pytest.mark.timeout(N)``) fails a test past
its limit with SIGALRM, naming it and dumping every thread's stack. A test stuck where that
signal cannot reach (inside C code that never returns to Python, or with the signal blocked)
is stopped ``HEADROOM_TEST_HARD_STOP_GRACE_S`` (default 60) seconds later by a watchdog thread,
which names it, dumps every thread's stack and ends the run (exit 3); the processes the tests
started die with it (``tests/processes.py``).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Generator

import pytest

#: how long past its limit a test that pytest-timeout could not stop runs before the watchdog
#: ends the run
HARD_STOP_GRACE_S = float(os.environ.get("HEADROOM_TEST_HARD_STOP_GRACE_S", "60"))


class _Watchdog:
    """The test running now, when it started and its limit; a daemon thread ends the process
    if it runs :data:`HARD_STOP_GRACE_S` past the limit."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.nodeid = ""
        self.started = 0.0
        self.limit_s = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="test-watchdog", daemon=True).start()

    def start(self, nodeid: str, limit_s: float) -> None:
        with self.lock:
            self.nodeid, self.started, self.limit_s = nodeid, time.monotonic(), limit_s

    def stop(self) -> None:
        with self.lock:
            self.limit_s = 0.0

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self.lock:
                over = self.limit_s > 0 and (
                    time.monotonic() - self.started > self.limit_s + HARD_STOP_GRACE_S
                )
                nodeid, limit_s = self.nodeid, self.limit_s
            if over:
                # out of pytest's capture, onto the real stderr (as pytest-timeout's own
                # thread method does), or the words would go with the process
                capture = self.config.pluginmanager.getplugin("capturemanager")
                if capture is not None:
                    capture.suspend_global_capture(in_=True)
                sys.stderr.write(
                    f"\n+++ {nodeid} ran {HARD_STOP_GRACE_S:.0f} s past its {limit_s:.0f} s "
                    "limit and could not be stopped; every thread's stack:\n"
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(3)


_watchdog: _Watchdog | None = None


def _limit_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    global _watchdog
    if _watchdog is None:
        _watchdog = _Watchdog(item.config)
    _watchdog.start(item.nodeid, _limit_s(item))
    try:
        return (yield)
    finally:
        _watchdog.stop()
