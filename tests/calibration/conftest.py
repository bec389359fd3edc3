"""Shared fixtures: the CPU rehearsal of the GPU matrix (``bench/calibration_sim.py``), and the
command line in process on a store of the test's own (``cli``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from typer.testing import CliRunner

from headroom.cli import app

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def calibration_sim() -> ModuleType:
    """``bench/calibration_sim.py`` as a module (bench/ is scripts, not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("calibration_sim")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``headroom ARGS`` in process, on a SQLite store in the test's folder."""
    monkeypatch.setenv("HEADROOM_DATABASE_URL", f"sqlite:///{tmp_path}/store.db")
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, list(args))

    return invoke
