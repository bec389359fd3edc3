"""The suite's own scheduling: under ``make test``'s ``--dist loadgroup`` (two workers here)
every group of ``SHARED`` runs on one worker, whatever xdist and pytest do with test ids
(``tests/scheduling.py``)."""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import processes
from scheduling import SHARED, WHOLE_FILE, scope

ROOT = Path(__file__).resolve().parents[1]
#: a few quick tests of each group's files, and one of no group
PICKED = [
    "tests/launch/test_slurm_jobs.py::test_a_job_the_controller_never_had_is_none",
    "tests/launch/test_slurm_jobs.py::test_the_batch_script_asks_for_the_allocation_and_quotes_every_argument",
    "tests/launch/test_slurm_run_files.py",
    "tests/calibration/test_killed_build.py::test_a_dead_builds_lock_is_cleared_and_the_op_built_again",
    "tests/calibration/test_killed_build.py::test_a_live_build_is_waited_for_and_a_killed_ones_lock_is_free",
    "tests/planner/test_deepspeed.py::test_the_buckets_are_deepspeeds_knobs",
    "tests/planner/test_deepspeed.py::test_zero3_steps_one_sub_group_at_a_time",
    "tests/test_bound_processes.py::test_run_is_subprocess_run_with_its_output",
]


def test_each_shared_group_runs_on_one_worker(tmp_path: Path) -> None:
    env = os.environ | {"HEADROOM_TEST_CACHE": str(tmp_path / "cache")}
    proc = processes.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", *PICKED],
        timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (\S+)", proc.stdout, re.M)
    assert len(ran) == 8, proc.stdout[-3000:]  # test_slurm_run_files.py holds one test
    assert {worker for worker, _ in ran} == {"gw0", "gw1"}  # both worked
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, nodeid in ran:
        workers[scope(nodeid)].add(worker)
    for group in SHARED:
        assert len(workers[group]) == 1, (group, workers[group])


def test_a_whole_file_is_one_unit_of_work_and_other_tests_are_their_own() -> None:
    """The tests of a ``WHOLE_FILE`` file share one unit (its module fixture is built once);
    two tests of any other file are two units."""
    for where in WHOLE_FILE:
        assert (ROOT / "tests" / where).is_file(), where
    matrix = "tests/calibration/test_sim_matrix.py::"
    assert scope(matrix + "test_the_grid_covers_the_gpu_matrix") == scope(
        matrix + "test_the_optimizer_phase_holds_what_the_planner_counts"
    )
    plan = "tests/planner/test_plan.py::"
    assert scope(plan + "test_a") != scope(plan + "test_b")
    assert scope("tests/planner/test_deepspeed.py::test_x") == "deepspeed_op"
