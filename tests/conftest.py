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
- ``make test`` runs the suite on two pytest-xdist workers (``--dist loadgroup``): the tests that
  share one thing of the machine run on one worker, in turn (``SHARED``).
"""

from __future__ import annotations

import os
from pathlib import Path

import caches
import compilers
import processes
import pytest

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


#: the tests that share one thing of the machine, by file: each group runs on one xdist worker,
#: one test after another (without xdist the whole suite runs so)
SHARED = {
    # the one-node Slurm clusters: a cluster's jobs use every CPU
    "slurm": (
        "launch/test_slurm_cluster.py",
        "launch/test_slurm_jobs.py",
        "launch/test_slurm_runs.py",
        "launch/test_slurm_run_files.py",
    ),
    # DeepSpeed's op, built once into this clone's torch_extensions folder (a second build of it
    # at the same time would wait on the first's lock)
    "deepspeed_op": ("planner/test_deepspeed.py", "calibration/test_killed_build.py"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = ROOT / "tests"
    for item in items:
        where = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        for group, files in SHARED.items():
            if where in files:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def _bound_processes() -> None:
    """Before any test starts a process: whatever the session starts carries its mark (the
    trainers an in-process supervisor starts too), and is killed once the session is gone,
    even when it is SIGKILLed (``processes.guard``)."""
    processes.guard()
