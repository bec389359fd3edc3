"""How ``make test`` spreads the suite over its xdist workers (``-n 3 --dist loadgroup``): the
tests that share one thing of the machine run on one worker, one after another (``SHARED``,
``SharedGroups``); so do the tests of a file that share a costly fixture (``WHOLE_FILE``); the
longest start first (``FIRST``); every other test goes to whichever worker is free.
``tests/conftest.py`` hooks these in."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parents[1]

#: the tests that share one thing of the machine, by file: each group runs on one xdist worker,
#: one test after another, in this order (without xdist the whole suite runs so)
SHARED = {
    # the one-node Slurm clusters: a cluster's jobs use every CPU
    "slurm": (
        "launch/test_slurm_cluster.py",
        "launch/test_slurm_jobs.py",
        "launch/test_slurm_runs.py",
        "launch/test_slurm_run_files.py",
    ),
    # DeepSpeed's op, built once into this clone's torch_extensions folder (a second build of it
    # at the same time would wait on the first's lock); the killed build's own second build, in
    # a folder of its own, then comes from ccache
    "deepspeed_op": ("planner/test_deepspeed.py", "calibration/test_killed_build.py"),
}
#: files whose tests share one costly module-scoped fixture: each file is one unit of work, so
#: the fixture is built once, not once on every worker that runs one of its tests (the GPU
#: matrix's and the state design's simulated runs, 50-60 s of CPU each on a slow 2-core VM, had
#: been built on two workers; the packaging tests' wheel on three)
WHOLE_FILE = (
    "calibration/test_sim_matrix.py",
    "calibration/test_sim_states.py",
    "test_packaging.py",
)
#: the longest tests (30 s and more on two workers), started before the rest so that the run
#: does not end on one of them with the other worker idle
FIRST = (
    "test_readme.py",
    "api/test_schemathesis.py",
    "api/test_fuzz_openapi.py",
    "runtime/test_capacity_bench.py",
    "cli/test_launch_summary.py",
)


def _where(path: Path) -> str:
    tests = ROOT / "tests"
    return path.relative_to(tests).as_posix() if path.is_relative_to(tests) else ""


def order(items: list[pytest.Item]) -> None:
    rank = {f: i for i, f in enumerate(f for files in SHARED.values() for f in files)}
    rank |= {f: len(rank) + i for i, f in enumerate(FIRST + WHOLE_FILE)}
    # a stable sort: the shared files in their groups' order, the longest tests, the rest as
    # collected (the scheduler hands out the groups first, the largest first, then the tests
    # one by one in this order)
    items.sort(key=lambda item: rank.get(_where(item.path), len(rank)))


class SharedGroups(LoadScopeScheduling):
    """``--dist loadgroup`` by ``SHARED``: each group's tests are one unit of work, every other
    test a unit of its own. xdist's own loadgroup names a test's group by appending it to the
    test's id, which pytest 9.2 no longer lets it change: its groups are silently dropped
    (pytest-dev/pytest-xdist#1386, open), so the scheduler groups the tests itself, by file."""

    def _split_scope(self, nodeid: str) -> str:
        return scope(nodeid)


def scope(nodeid: str) -> str:
    """A test's unit of work: its ``SHARED`` group, else its file if that is ``WHOLE_FILE``,
    else the test itself."""
    where = _where(ROOT / nodeid.split("::", 1)[0])
    if where in WHOLE_FILE:
        return where
    return next((g for g, files in SHARED.items() if where in files), nodeid)
