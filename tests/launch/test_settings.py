"""A launch's settings and shape take what they say: counts are integers and never booleans
(``nodes: true`` was one node), and a Slurm time limit is one of Slurm's forms from a minute to
a year (``0`` and ``-1``, which Slurm reads as no limit at all, ran the job unlimited); through
the settings' environment variables and ``headroom launch`` (exit 2) alike."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from headroom_process import run_headroom
from pydantic import ValidationError

from headroom.launch.k8s import K8sOverrides, K8sSettings
from headroom.launch.settings import ClusterShape, LaunchSettings, from_environment, slurm_seconds
from headroom.launch.slurm import SlurmOverrides, SlurmSettings
from headroom.planner import SpecError

#: Slurm's forms of a time limit, and the seconds each stands for
FORMS = {
    "1": 60,
    "90": 5400,
    "1:30": 90,
    "0:60": 60,
    "01:00:00": 3600,
    "2-0": 2 * 86400,
    "1-12:30": 86400 + 12 * 3600 + 30 * 60,
    "1-2:3:4": 86400 + 2 * 3600 + 3 * 60 + 4,
    "365-0:0:0": 365 * 86400,
}
#: none at all to Slurm, under a minute, over a year, or no form of Slurm's
REFUSED = ["0", "-1", "00:00:00", "0-0", "0:59", "366-0", "UNLIMITED", "INFINITE", "1:2:3:4", ""]


@pytest.mark.parametrize(("text", "seconds"), sorted(FORMS.items()))
def test_each_of_slurms_time_forms_is_read_and_taken(text: str, seconds: int) -> None:
    assert slurm_seconds(text) == seconds
    assert SlurmOverrides(time_limit=text).time_limit == text
    assert SlurmSettings(time_limit=text).time_limit == text


@pytest.mark.parametrize("text", REFUSED)
def test_a_time_limit_of_no_limit_or_no_form_is_refused_naming_it(text: str) -> None:
    for shape in (SlurmOverrides, SlurmSettings):
        with pytest.raises(ValidationError) as refused:
            shape(time_limit=text)
        (error,) = refused.value.errors()
        assert error["loc"] == ("time_limit",), error
        assert "allowed: 1 minute to 365 days as M, M:S, H:M:S" in error["msg"], error


def test_the_environments_time_limit_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HEADROOM_SLURM_TIME_LIMIT", "0")
    with pytest.raises(SpecError) as refused:
        from_environment(SlurmSettings)
    assert refused.value.field == "HEADROOM_SLURM_TIME_LIMIT"
    assert "'0' is under a minute" in str(refused.value) and "got '0'" in str(refused.value)


@pytest.mark.parametrize(
    ("shape", "count"),
    [
        (ClusterShape, "nodes"),
        (ClusterShape, "gpus_per_node"),
        (SlurmOverrides, "nodes"),
        (SlurmOverrides, "gpus_per_node"),
        (K8sOverrides, "nodes"),
        (K8sOverrides, "gpus_per_node"),
        (SlurmSettings, "gpus_per_node"),
        (SlurmSettings, "ranks_per_node"),
        (K8sSettings, "gpus_per_node"),
        (K8sSettings, "ranks_per_node"),
        (LaunchSettings, "max_running"),
    ],
)
def test_a_count_is_an_integer_never_a_boolean(shape: type, count: str) -> None:
    for flag in (True, False):
        with pytest.raises(ValidationError) as refused:
            shape(**{count: flag})
        (error,) = refused.value.errors()
        assert error["loc"] == (count,), error
        assert "must be an integer, not a boolean" in error["msg"], error
    # a whole number written as a float is that integer (JSON Schema's integer)
    assert getattr(shape(**{count: 2.0}), count) == 2


def _launch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``headroom launch --backend slurm`` of a tiny run that never reaches Slurm (refused)."""
    return run_headroom(
        "launch", "tiny-dense", "--set", "seq_len=16", "--backend", "slurm", *args,
        timeout=120,
        env={
            **os.environ,
            "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/runs.db",
            "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
            **env,
        },
    )  # fmt: skip


@pytest.mark.parametrize("time_limit", ["0", "-1", "00:00:00", "UNLIMITED"])
def test_headroom_launch_refuses_a_time_limit_of_no_limit_with_exit_2(
    tmp_path: Path, time_limit: str
) -> None:
    refused = _launch(tmp_path, f"--slurm-time-limit={time_limit}")
    assert refused.returncode == 2, refused.stderr
    assert "--slurm-time-limit" in refused.stderr and "allowed: 1 minute" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "runs.db").exists()
    setting = _launch(tmp_path, HEADROOM_SLURM_TIME_LIMIT=time_limit)
    assert setting.returncode == 2, setting.stderr
    assert "HEADROOM_SLURM_TIME_LIMIT" in setting.stderr and "allowed: 1 minute" in setting.stderr
    assert not (tmp_path / "runs.db").exists()
