"""``headroom.calibration``'s public surface: a sorted ``__all__`` of names that exist, importable
without torch, numpy or matplotlib (the service imports it for the trust rule)."""

from __future__ import annotations

import subprocess
import sys

import headroom.calibration as calibration


def test_all_is_sorted_and_complete() -> None:
    assert calibration.__all__ == sorted(calibration.__all__)
    assert all(hasattr(calibration, name) for name in calibration.__all__)


def test_the_package_imports_without_torch_numpy_or_matplotlib() -> None:
    code = (
        "import sys, headroom.calibration\n"
        "heavy = {'torch', 'numpy', 'matplotlib', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
