"""The command line's exit codes, and the one place a user mistake becomes an exit.

Every command exits through ``ExitCode``; a user mistake (a ``planner.HeadroomError``: a bad
spec, an unknown preset, an unreadable file) becomes one ``error: ...`` line on stderr and exit 2
through ``user_errors``. A mistake in the command's environment that surfaces wherever the
command first touches it (an invalid ``HEADROOM_*`` setting, a database URL that cannot be parsed
or reached) and a host out of memory are turned into one line at the root, ``main()``, by
``environment_error``. Tracebacks are for bugs.

Two codes carry two meanings each, told apart by the command that exits with them: 1 is a
predicted OOM (``gate``) or nothing that fits (``fit``, ``launch``, ``calibrate``), and 3 is
"cannot decide" (``gate --require-calibration``, ``estimate --calibrated``) or the trainer ran out
of memory (``train``, ``launch``, ``calibrate run``). The names below keep the meanings apart.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path

import pydantic
import typer

from headroom import planner

__all__ = [
    "EXTRA_OF",
    "ExitCode",
    "environment_error",
    "fail",
    "is_out_of_memory",
    "missing_extra",
    "user_errors",
    "writable",
    "writing",
]


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
    STORE_UNAVAILABLE = 2
    """``launch``/``calibrate``/``serve``: ``HEADROOM_DATABASE_URL`` cannot be parsed, or the
    database it names cannot be reached. A configuration mistake like any invalid input, and a
    launcher reads 1, 3 and 4 as the run's outcome, which an unreachable store is not."""
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


def writable(option: str, path: Path) -> None:
    """Refuse (exit 2, naming ``option``) a file the command could not write, before the work
    that would end in writing it: the file is opened for appending (created empty if missing,
    which a reader takes for no report) so that every reason the OS has is asked, not guessed."""
    with writing(option, path), path.open("a"):
        pass


@contextmanager
def writing(option: str, path: Path) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into one line naming ``option``, exit 2."""
    try:
        yield
    except OSError as exc:
        raise fail(f"{option}: cannot write {path} ({exc.strerror or exc})") from None


#: what torch's and the C allocators say when a host allocation fails (a RuntimeError, not
#: torch.OutOfMemoryError, which is the device's)
_OUT_OF_MEMORY_TEXT = ("can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the host or the device running out of memory."""
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    if type(exc).__name__ == "OutOfMemoryError":  # torch's, without importing torch here
        return True
    text = str(exc).lower()
    return any(words in text for words in _OUT_OF_MEMORY_TEXT)


#: the prefix of the settings' environment variables (``StoreSettings.model_config``)
_ENV_PREFIX = "HEADROOM_"


def _settings_message(exc: pydantic.ValidationError) -> str:
    """``HEADROOM_NAME: what is allowed, got 'value'`` per invalid setting."""
    parts = []
    for err in exc.errors():
        name = _ENV_PREFIX + "_".join(str(p) for p in err["loc"][:1]).upper()
        got = err.get("input")
        parts.append(f"{name}: {err['msg'].removeprefix('Value error, ')}, got {got!r}")
    return "; ".join(parts)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def environment_error(exc: BaseException) -> tuple[str, ExitCode] | None:
    """The one line and the exit for a mistake in the command's environment (a missing extra,
    a bad setting, an unusable store), for the machine running out of memory, or for a user
    mistake a command did not catch itself; None for anything else (a bug: its traceback stays).

    The store's errors are recognised only when SQLAlchemy is loaded: a command that never
    opened the store cannot raise them, and the CLI must not import it to ask."""
    if isinstance(exc, planner.HeadroomError):
        return str(exc), ExitCode.INVALID_INPUT
    if isinstance(exc, ModuleNotFoundError):
        missing = missing_extra(exc)
        return None if missing is None else (missing, ExitCode.INVALID_INPUT)
    if isinstance(exc, pydantic.ValidationError) and exc.title.endswith("Settings"):
        # the service's, the launch layer's or the store's settings, read from HEADROOM_*
        return _settings_message(exc), ExitCode.INVALID_INPUT
    db = sys.modules.get("sqlalchemy.exc")
    if db is not None and isinstance(exc, db.ArgumentError):
        return (
            f"{_ENV_PREFIX}DATABASE_URL: cannot parse it as a database URL ({_first_line(exc)}); "
            "allowed: sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE",
            ExitCode.STORE_UNAVAILABLE,
        )
    if db is not None and isinstance(exc, (db.OperationalError, db.InterfaceError)):
        reason = _first_line(exc.orig if exc.orig is not None else exc)
        return (
            f"{_ENV_PREFIX}DATABASE_URL: cannot use the database ({reason})",
            ExitCode.STORE_UNAVAILABLE,
        )
    if is_out_of_memory(exc):
        return f"out of memory: {_first_line(exc)}", ExitCode.OUT_OF_MEMORY
    return None


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
            "machine needs (e.g. pip install torch), then pip install 'headroom-planner[runtime]'"
        )
    extra = EXTRA_OF.get(package)
    if extra is None:
        return None
    return (
        f"this command needs {package}, which is not installed: "
        f"pip install 'headroom-planner[{extra}]'"
    )
