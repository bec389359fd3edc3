"""Shared fixtures: the CPU rehearsal of the GPU matrix (``bench/calibration_sim.py``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def calibration_sim() -> ModuleType:
    """``bench/calibration_sim.py`` as a module (bench/ is scripts, not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("calibration_sim")
    finally:
        sys.path.remove(str(BENCH))
