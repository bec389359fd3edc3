"""Settings for the whole suite: nothing it builds or caches is shared with another clone or
user, and no test runs past its time limit.

- The caches that torch, triton, inductor, matplotlib and transformers keep under the user's
  home (``~/.cache/torch_extensions`` holds DeepSpeed's op and the ``lock`` a killed build
  leaves) live under ``.venv/cache`` in this clone (``HEADROOM_TEST_CACHE`` moves them: the
  test of a killed build gives its own run a fresh folder). Set before any test imports torch;
  the processes the tests start inherit them.
- Every test has a time limit (``timeout`` in pyproject.toml, ``@pytest.mark.timeout(N)`` for
  the few that need more): pytest-timeout fails it on expiry, naming it and dumping every
  thread's stack; a test that signal cannot reach is stopped a minute later, and the run with
  it (``tests/time_limits.py``).
- Whatever the session starts carries its mark and is killed once the session is gone, even
  when it is SIGKILLed, and what a killed earlier run left is killed at the start
  (``tests/processes.py``: ``guard``).
- C++ compiles through ccache where it is installed, its store in this clone
  (``tests/compilers.py``): DeepSpeed's op, built from scratch in two folders (the killed
  build's test builds into one of its own), is compiled once.
- A run that is stopped can leave a half-written kernel in inductor's cache: the next run
  finds the stopped run's mark and removes the compiled caches first (``tests/caches.py``).
- ``make test`` runs the suite on three pytest-xdist workers (``--dist loadgroup``): the tests that
  share one thing of the machine run on one worker, in turn, and
  the longest start first (``tests/scheduling.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import caches
import compilers
import processes
import pytest
import scheduling

# every test's hard stop behind pytest-timeout (its own module: a pytest of a test's own loads
# it with ``-p time_limits``)
from time_limits import pytest_runtest_protocol  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("HEADROOM_TEST_CACHE") or ROOT / ".venv" / "cache")
#: each cache's variable and its folder under CACHE
CACHES = {
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "MPLCONFIGDIR": "matplotlib",
    "HF_HOME": "huggingface",
    "XDG_CACHE_HOME": "xdg",
}
for _variable, _folder in CACHES.items():
    os.environ[_variable] = str(CACHE / _folder)
compilers.use_ccache(CACHE)


#: where the run keeps its mark on the caches (``caches.claim``)
_CACHE_MARK = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """The run (not each xdist worker) claims the caches before any test compiles."""
    if not hasattr(config, "workerinput"):
        mark, removed = caches.claim(CACHE)
        config.stash[_CACHE_MARK] = mark
        if removed:
            print(f"removed {', '.join(removed)} under {CACHE}: a run that used them was stopped")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that ends by itself (its tests passed or failed; not interrupted) releases the
    caches; one that is stopped leaves its mark for the next run to find."""
    mark = session.config.stash.get(_CACHE_MARK, None)
    ended = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
    if mark is not None and exitstatus in ended:
        caches.release(mark)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    scheduling.order(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> scheduling.SharedGroups | None:
    return scheduling.SharedGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.fixture(scope="session", autouse=True)
def _bound_processes() -> None:
    """Before any test starts a process: whatever the session starts carries its mark (the
    trainers an in-process supervisor starts too), and is killed once the session is gone,
    even when it is SIGKILLed (``processes.guard``)."""
    processes.guard()
