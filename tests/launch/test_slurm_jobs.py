"""The Slurm backend's pieces against a real one-node Slurm cluster (``tests/slurm_cluster``):
a job killed by a signal read back from the controller and turned into a run's ending, a job
the controller never had, and the batch script's allocation and quoting. The trainer's jobs
(completion with two ranks, out of memory, cancelled, killed) run as runs, through
``headroom launch`` and ``POST /runs``, in ``test_slurm_runs.py``."""

from __future__ import annotations

import time
from pathlib import Path

from headroom.launch import slurm

WAIT_S = 120.0


def _wait(job_id: str, env: dict[str, str], states: frozenset[str]) -> slurm.JobState:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job = slurm.job_state(job_id, env)
        assert job is not None
        if job.state in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never reached {sorted(states)}: {job}")


def test_slurm_job_killed_by_a_signal_says_which(cluster: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "killed.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'killed.log'}\nkill -9 $$\n")
    job = _wait(slurm.submit(script, cluster), cluster, slurm.ENDED)
    assert (job.state, job.signal) == ("FAILED", 9)
    assert slurm.ending(job) == ("failed", "killed by SIGKILL")


def test_a_job_the_controller_never_had_is_none(cluster: dict[str, str]) -> None:
    assert slurm.job_state("999999", cluster) is None


def test_the_batch_script_asks_for_the_allocation_and_quotes_every_argument() -> None:
    settings = slurm.SlurmSettings(
        partition="gpu", account="ml team", time_limit="02:00:00", gpus_per_node=8,
        ranks_per_node=8,
    )  # fmt: skip
    text = slurm.batch_script(
        ["llama-3-8b", "--set", "seq_len=8192; rm -rf /"],
        job_name="headroom-run",
        log=Path("/runs/a b/trainer.log"),
        nodes=4,
        settings=settings,
        python="/venv/bin/python",
    )
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --account='ml team'" in text
    assert "#SBATCH --time=02:00:00" in text
    assert "#SBATCH --output='/runs/a b/trainer.log'" in text
    assert "--nproc-per-node 8" in text and "--nnodes 4" in text
    assert "torch.distributed.run" in text and '--rdzv-endpoint "$head:29500"' in text
    assert "'seq_len=8192; rm -rf /'" in text
