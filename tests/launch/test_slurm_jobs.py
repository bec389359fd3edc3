"""The Slurm backend's pieces against a real one-node Slurm cluster (``tests/slurm_cluster``):
a batch script that runs the trainer through ``srun`` and ``torchrun`` to completion, a
trainer out of memory (exit 3), a cancelled job and a job killed by a signal, each read back
from the controller and turned into a run's ending."""

from __future__ import annotations

import sys
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


def _trainer_job(tmp_path: Path, env: dict[str, str], *extra: str) -> tuple[str, Path]:
    log = tmp_path / "trainer.log"
    script = tmp_path / "job.sbatch"
    args = ["tiny-dense", "--set", "micro_batch_size=1", "--set", "seq_len=16", *extra]
    script.write_text(
        slurm.batch_script(
            args,
            job_name="headroom-test",
            log=log,
            nodes=1,
            settings=slurm.SlurmSettings(),
            python=sys.executable,
        )
    )
    return slurm.submit(script, env), log


def test_slurm_runs_the_trainer_to_completion(cluster: dict[str, str], tmp_path: Path) -> None:
    job_id, log = _trainer_job(tmp_path, cluster, "--steps", "2")
    job = _wait(job_id, cluster, slurm.ENDED)
    assert slurm.ending(job) == ("succeeded", "completed"), log.read_text()
    assert "step" in log.read_text().lower()


def test_slurm_job_out_of_memory_is_a_failed_run_saying_so(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    job_id, log = _trainer_job(tmp_path, cluster, "--steps", "2", "--memory-cap", "64KiB")
    job = _wait(job_id, cluster, slurm.ENDED)
    assert (job.state, job.exit_code) == ("FAILED", 3), log.read_text()
    assert slurm.ending(job) == ("failed", "out of memory (exit 3)")


def test_slurm_cancel_ends_the_job_cancelled(cluster: dict[str, str], tmp_path: Path) -> None:
    job_id, _ = _trainer_job(tmp_path, cluster, "--steps", "100000")
    _wait(job_id, cluster, frozenset({"RUNNING"}))
    slurm.cancel(job_id, cluster)
    job = _wait(job_id, cluster, slurm.ENDED)
    assert slurm.ending(job) == ("cancelled", "cancelled (scancel)")


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
