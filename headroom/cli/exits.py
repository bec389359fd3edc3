"""The command line's exit codes, and the one place a user mistake becomes an exit.

Every command exits through ``ExitCode``; a user mistake (a ``planner.HeadroomError``: a bad
spec, an unknown preset, an unreadable file) becomes one ``error: ...`` line on stderr and exit 2
through ``user_errors``. Tracebacks are for bugs.

Two codes carry two meanings each, told apart by the command that exits with them: 1 is a
predicted OOM (``gate``) or nothing that fits (``fit``, ``launch``, ``calibrate``), and 3 is
"cannot decide" (``gate --require-calibration``, ``estimate --calibrated``) or the trainer ran out
of memory (``train``, ``launch``, ``calibrate run``). The names below keep the meanings apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum

import typer

from headroom import planner

__all__ = ["EXTRA_OF", "ExitCode", "fail", "missing_extra", "user_errors"]


class ExitCode(IntEnum):
    """What ``headroom`` exits with (aliases share a number, not a meaning)."""

    OK = 0
    """The run fits, a plan was found, the command did what it was asked."""
    PREDICTED_OOM = 1
    """``gate``: the estimate (plus margin) exceeds the GPU (``planner.gate``'s verdict)."""
    NOTHING_FITS = 1
    """``fit``/``launch``: no candidate fits (or no probe confirmed one); ``calibrate``: nothing
    was refitted, or the measured run failed without running out of memory."""
    INVALID_INPUT = 2
    """A user mistake: one ``error: ...`` line on stderr."""
    UNDECIDED = 3
    """``gate --require-calibration``/``estimate --calibrated``: no calibrated coefficients."""
    OUT_OF_MEMORY = 3
    """``train``: the device ran out of memory (the launcher reads this to step down)."""
    RUN_FAILED = 4
    """``launch``: the trainer failed other than by running out of memory."""
    CANCELLED = 130
    """``launch``: the run was cancelled."""


def fail(message: str, code: ExitCode = ExitCode.INVALID_INPUT) -> typer.Exit:
    """Print ``error: MESSAGE`` on stderr; the caller raises the returned exit."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def user_errors(
    code: ExitCode = ExitCode.INVALID_INPUT,
    errors: tuple[type[Exception], ...] = (planner.HeadroomError,),
) -> Iterator[None]:
    """Turn ``errors`` raised in the block into one ``error:`` line and exit ``code``."""
    try:
        yield
    except errors as exc:
        raise fail(str(exc), code) from None


#: the extra that installs each optional package a command may import when it runs
EXTRA_OF: dict[str, str] = {
    "alembic": "service",
    "fastapi": "service",
    "httptools": "service",
    "prometheus_fastapi_instrumentator": "service",
    "psycopg": "service",
    "pydantic_settings": "service",
    "pynvml": "service",
    "sqlalchemy": "service",
    "uvicorn": "service",
    "matplotlib": "calibration",
    "numpy": "calibration",
    "transformers": "hf",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """What to install for a command whose optional package is absent (None: not one of ours)."""
    package = (exc.name or "").partition(".")[0]
    if package == "torch":
        return (
            "this command runs PyTorch, which is not installed: install the torch build your "
            "machine needs (e.g. pip install torch), then pip install 'headroom[runtime]'"
        )
    extra = EXTRA_OF.get(package)
    if extra is None:
        return None
    return f"this command needs {package}, which is not installed: pip install 'headroom[{extra}]'"
