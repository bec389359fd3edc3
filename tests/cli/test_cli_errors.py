"""Mistakes in a command's input or environment end in one ``error: ...`` line and exit 2 (3 when
the trainer runs out of memory), never a traceback: each through the real ``headroom`` process."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import pytest

from headroom.cli import ExitCode
from tests.headroom_process import run_headroom, run_wide


def env(**extra: str) -> dict[str, str]:
    """This process's environment (PYTHONPATH: this tree) with ``extra`` set."""
    return {**os.environ, **extra}


def assert_one_error_line(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Exit ``code`` and a stderr of exactly one ``error:`` line that contains each of ``words``."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], proc.stderr
    assert proc.returncode == code, proc.stderr
    return lines[0]


def test_a_model_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes('{"name": "café", "num_layers": 2}'.encode("latin-1"))
    proc = run_headroom("estimate", str(path))
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, str(path), "UTF-8")


def test_an_override_with_more_digits_than_python_converts() -> None:
    proc = run_headroom("estimate", "tiny-dense", "--set", "micro_batch_size=" + "1" * 5000)
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, "--set", "micro_batch_size")


def test_a_train_file_with_more_digits_than_python_converts(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text('{"micro_batch_size": ' + "1" * 5000 + "}")
    proc = run_headroom("estimate", "tiny-dense", "--train", str(path))
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, str(path))


@pytest.mark.parametrize("where", ["missing/dir/report.json", "/proc/version"])
def test_train_report_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, where: str
) -> None:
    report = where if where.startswith("/") else str(tmp_path / where)
    proc = run_headroom(
        "train", "tiny-dense", "--steps", "1", "--device", "cpu", "--report", report
    )
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, "--report", report)
    assert proc.stdout == ""  # refused before training, not after


def test_train_seed_beyond_what_torch_takes() -> None:
    proc = run_headroom("train", "tiny-dense", "--steps", "1", "--seed", "9" * 23)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitCode.INVALID_INPUT, proc.stderr
    assert "--seed" in proc.stderr
    assert "4294967295" in proc.stderr  # the allowed range


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("garbage", "cannot parse"),
        ("postgresql+psycopg://127.0.0.1:1/x", "connection failed"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["launch", "tiny-dense", "--device", "cpu"],
        ["calibrate", "fit"],
        ["calibrate", "report"],
        ["serve", "--port", "1"],  # HEADROOM_MIGRATE (default true): upgraded before serving
    ],
)
def test_a_database_url_that_cannot_be_used(command: list[str], url: str, reason: str) -> None:
    proc = run_headroom(*command, env=env(HEADROOM_DATABASE_URL=url), timeout=120)
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, "HEADROOM_DATABASE_URL", reason)


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("HEADROOM_MAX_BODY_BYTES", "abc", "integer"),
        ("HEADROOM_MAX_BODY_BYTES", "10", "1024"),
        ("HEADROOM_RUN_DEVICE", "tpu", "'auto', 'cpu' or 'cuda'"),
    ],
)
def test_serve_with_an_invalid_setting(tmp_path: Path, name: str, value: str, allowed: str) -> None:
    proc = run_headroom(
        "serve",
        "--port",
        "1",  # never bound: the settings are refused first
        env=env(**{name: value, "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'h.db'}"}),
        timeout=60,
    )
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, name, allowed, repr(value))


def test_calibrate_report_png_to_a_path_that_cannot_be_written(tmp_path: Path) -> None:
    png = tmp_path / "missing" / "plot.png"
    proc = run_headroom(
        "calibrate",
        "report",
        "--png",
        str(png),
        env=env(HEADROOM_DATABASE_URL=f"sqlite:///{tmp_path / 'h.db'}"),
    )
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, "--png", str(png))


def test_calibrate_report_png_writes_the_name_given(tmp_path: Path) -> None:
    png = tmp_path / "plot"
    proc = run_headroom(
        "calibrate",
        "report",
        "--png",
        str(png),
        env=env(HEADROOM_DATABASE_URL=f"sqlite:///{tmp_path / 'h.db'}"),
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "plot.png").exists()


def _limit_address_space() -> None:
    """The child's memory limit: room for Python and torch, not for 2^30 tokens (8 GiB)."""
    limit = 4 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_train_whose_tokens_exceed_the_memory_limit_exits_out_of_memory() -> None:
    proc = run_headroom(
        "train",
        "tiny-dense",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--memory-cap",
        "64MiB",
        "--set",
        f"seq_len={2**30}",
        preexec_fn=_limit_address_space,
        timeout=120,
    )
    assert_one_error_line(proc, ExitCode.OUT_OF_MEMORY, "out of memory")


@pytest.mark.parametrize("command", ["gate", "fit"])
@pytest.mark.parametrize("margin", ["nan", "inf", "-inf"])
def test_a_margin_that_is_not_a_finite_number(command: str, margin: str) -> None:
    proc = run_headroom(command, "tiny-dense", "--margin", margin)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ExitCode.INVALID_INPUT, proc.stderr
    assert "--margin" in proc.stderr
    assert "finite number from 0 to 100" in proc.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["plan", "llama-3-8b", "--gpus", "0", "--global-batch", "8", "--seq", "4096"],
            ["--gpus", "greater than or equal to 1", "headroom plan --help"],
        ),
        (["estimate", "tiny-dense", "--bogus"], ["--bogus", "headroom estimate --help"]),
        (["gate", "tiny-dense", "--format", "xml"], ["--format", "headroom gate --help"]),
        (["no-such-command"], ["no-such-command"]),
    ],
)
def test_a_command_line_mistake_is_one_line_not_a_box(args: list[str], words: list[str]) -> None:
    """What the parser refuses (a value out of range, an unknown option or command) reads as
    every other mistake does: one ``error:`` line naming the option, exit 2."""
    proc = run_headroom(*args)
    assert "╭" not in proc.stderr and "Usage:" not in proc.stderr, proc.stderr
    assert_one_error_line(proc, ExitCode.INVALID_INPUT, *words)


def test_a_bare_group_prints_its_help_and_exits_2() -> None:
    proc = run_headroom("calibrate")
    assert proc.returncode == ExitCode.INVALID_INPUT
    assert "trace" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_version_names_the_distribution_and_its_version() -> None:
    from importlib import metadata

    proc = run_headroom("--version")
    assert proc.returncode == 0, proc.stderr
    version = metadata.version("headroom-planner")
    assert proc.stdout.strip() == f"headroom {version} (headroom-planner)"


def test_compare_help_names_every_framework_and_profile() -> None:
    from headroom import planner

    proc = run_wide("estimate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert all(f in text for f in planner.FRAMEWORKS), text
    assert all(p in text for p in planner.profiles()), text
