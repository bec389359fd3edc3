"""A Slurm run's directory is as private as a local run's: 0700, every file in it 0600.

Slurm creates a job's output file (the run's ``log.txt``) itself, before the batch script's
``umask 077`` runs, with the umask sbatch was started under: on a host whose umask is 022 the
log was 0644, readable by every user of the host, where the README promises 0600. Against the
real one-node cluster of ``tests/slurm_cluster``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_client import wait_for
from fastapi.testclient import TestClient
from run_rows import AUTH, TINY, run_settings

from headroom.api.main import create_app


@pytest.fixture
def shared_umask() -> Iterator[None]:
    """The umask most hosts give a service: what it creates is readable by everyone."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_slurm_run_directory_and_its_files_are_private(
    cluster: dict[str, str], tmp_path: Path, shared_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with TestClient(create_app(run_settings(tmp_path))) as client:
        created = client.post(
            "/api/v1/runs", json={**TINY, "steps": 2, "backend": "slurm"}, headers=AUTH
        )
        assert created.status_code == 201, created.text
        done = wait_for(
            lambda: (
                (r := client.get(f"/api/v1/runs/{created.json()['id']}").json())["status"]
                in ("succeeded", "failed", "cancelled")
                and r
            ),
            what="the Slurm run to end",
        )
    assert done["status"] == "succeeded", done
    directory = tmp_path / "runs" / done["uid"]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    modes = {
        str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*")
    }
    # the service's files, Slurm's output and what the trainer wrote
    assert {"job.sbatch", "model.json", "train.json", "log.txt", "report.json"} <= set(modes)
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not loose, f"readable by others on the host: {loose}"
