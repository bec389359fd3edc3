"""The compiled code the suite caches in this clone (``tests/conftest.py``: inductor's and
triton's kernels under ``.venv/cache``), which a killed run can leave half-written.

Inductor writes a kernel's shared object where it loads it from: a run stopped while gcc
writes one leaves a file too short to load, and every later run that compiles the same graph
fails on it (``ImportError: ... .so: file too short``). So a run marks the cache as in use
(``claim``) and clears the mark only when it ends by itself (``release``); a run that finds a
mark whose owner is gone knows the cache may hold such files and removes the compiled folders
before any test compiles (they are rebuilt on first use). A mark whose owner is alive is
another run of this clone, still going: nothing is removed under it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import processes

#: a run's mark: this prefix and its owner (``processes.identity``)
MARK_PREFIX = ".in-use-"
#: the folders of compiled code a killed run may leave half-written
COMPILED = ("inductor", "triton")


def _owner(mark: Path) -> str:
    return mark.name[len(MARK_PREFIX) :]


def claim(cache: Path) -> tuple[Path, list[str]]:
    """Mark ``cache`` as used by this process, first removing the compiled folders if a run
    that used it was stopped (its mark's owner is gone) and no run still uses it; (the mark,
    the folders removed)."""
    cache.mkdir(parents=True, exist_ok=True)
    marks = list(cache.glob(f"{MARK_PREFIX}*"))
    stale = [m for m in marks if not processes.alive(_owner(m))]
    removed: list[str] = []
    if stale and len(stale) == len(marks):
        for folder in COMPILED:
            if (cache / folder).exists():
                shutil.rmtree(cache / folder, ignore_errors=True)
                removed.append(folder)
        for mark in stale:
            mark.unlink(missing_ok=True)
    mark = cache / f"{MARK_PREFIX}{processes.identity(os.getpid())}"
    mark.touch()
    return mark, removed


def release(mark: Path) -> None:
    """The run that made ``mark`` ended by itself: nothing it compiled is half-written."""
    mark.unlink(missing_ok=True)
