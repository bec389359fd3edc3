"""The tests' one way to run the ``headroom`` command in its own process, as a user does."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def run_headroom(
    *args: str, timeout: float = 300, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``headroom ARGS`` with this interpreter, its output captured as text; ``options`` go to
    ``subprocess.run`` (``env``, ``cwd``)."""
    return subprocess.run(
        [sys.executable, "-m", "headroom", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **options,
    )
