"""A run's directory: where it is, what the service writes there, how the run ended, and how
long the directory is kept.

Every run keeps its files in ``RUN_DIR/<uid>/`` (``run_dir``): the validated specs the trainer
reads, its log and report, and ``ending.json``, how the trainer ended as its supervisor saw it.
The directory is private to the service's user (0700, its files 0600, the trainer started with
umask 077): a log and a spec say more about a model than others on a shared host should read.
``ending.json`` is written before the store is told, so an ending outlives a database that is
away and a service that stops before it returns: the next supervisor records it
(``Supervisor.reconcile``). With ``HEADROOM_RUN_RETENTION_DAYS`` set, the directories of runs
that ended longer ago than that are removed (``remove_expired``); their rows stay, and the
service says the log was removed rather than that there is none (``removed_by_retention``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from headroom import store
from headroom.store import Run

#: a run directory's mode and its files' (the trainer's own files: its umask, 077)
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
#: the file in a run's directory that says how its trainer ended
ENDING_FILE = "ending.json"
#: the states of a run that has ended
ENDED = ("succeeded", "failed", "cancelled")


class RunDirSettings(Protocol):
    """What the run directories' functions read of the settings."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def run_retention_days(self) -> float | None: ...


def run_dir(settings: RunDirSettings, run: Run) -> Path:
    """The run's own directory, ``RUN_DIR/<uid>``, resolved. A uid that would not name a
    directory directly inside RUN_DIR (``.``, ``..``, a separator, a link out: a row stored
    before uids were checked, or by hand) is refused with ``ValueError``: a run never writes
    outside RUN_DIR."""
    base = Path(settings.run_dir).resolve()
    directory = (base / run.uid).resolve()
    if directory.parent != base:
        raise ValueError(
            f"uid: {run.uid[:64]!r} does not name a directory inside the run directory; "
            f"allowed: {store.RUN_UID_RULE}"
        )
    return directory


def inside_run_dir(settings: RunDirSettings, path: str | Path) -> Path:
    """``path`` resolved, if it lies inside RUN_DIR; ``ValueError`` if not. Every file a run's
    row names (its log, its report) is read through here, so a stored path cannot point the
    service at another file."""
    base = Path(settings.run_dir).resolve()
    resolved = Path(path).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise ValueError("the path is not inside the run directory")
    return resolved


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and RUN_DIR, if missing) readable by this user only."""
    directory.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    directory.chmod(PRIVATE_DIR)  # mkdir's mode passes through the umask; an old one is reset


def _open_private(path: Path, flags: int) -> int:
    fd = os.open(path, flags | os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)  # a file that existed keeps its mode otherwise
    return fd


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only."""
    with os.fdopen(_open_private(path, os.O_TRUNC), "w") as f:
        f.write(text)


def open_log(path: Path) -> IO[bytes]:
    """The run's log, opened for appending, readable by this user only."""
    return os.fdopen(_open_private(path, os.O_APPEND), "ab")


@dataclass(frozen=True)
class Ending:
    """How a run ended, as its store row will say: ``transitions.finish``'s arguments."""

    status: str
    reason: str
    exit_code: int | None


def save_ending(directory: Path | None, ending: Ending) -> None:
    """Keep ``ending`` in the run's directory (replaced whole: a reader never sees half)."""
    if directory is None or not directory.is_dir():
        return
    partial = directory / f".{ENDING_FILE}.partial"
    write_private(partial, json.dumps(asdict(ending)))
    partial.replace(directory / ENDING_FILE)


def read_ending(directory: Path) -> Ending | None:
    """The ending kept in the run's directory (None: none, or not readable as one)."""
    try:
        kept = json.loads((directory / ENDING_FILE).read_text())
        ending = Ending(
            status=str(kept["status"]), reason=str(kept["reason"]), exit_code=kept["exit_code"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if ending.status not in ("succeeded", "failed"):
        return None
    if ending.exit_code is not None and not isinstance(ending.exit_code, int):
        return None
    return ending


def retention_cutoff(
    settings: RunDirSettings, now: dt.datetime | None = None
) -> dt.datetime | None:
    """Runs that ended before this lose their directories (None: directories are kept)."""
    days = settings.run_retention_days
    if days is None:
        return None
    return (now or store.utcnow()) - dt.timedelta(days=days)


def removed_by_retention(settings: RunDirSettings, run: Run) -> bool:
    """Whether ``run`` ended long enough ago that retention has removed (or will remove) its
    directory."""
    cutoff = retention_cutoff(settings)
    finished = store.as_utc(run.finished_at)
    return cutoff is not None and run.status in ENDED and finished is not None and finished < cutoff


def remove_expired(
    session: Session,
    settings: RunDirSettings,
    keep: set[int] | frozenset[int] = frozenset(),
    now: dt.datetime | None = None,
) -> int:
    """Remove the directories of runs that ended before the retention cutoff, except runs in
    ``keep`` (whose ending is still being recorded); how many. A directory whose name is no
    run's uid is not Headroom's to remove, and is left."""
    cutoff = retention_cutoff(settings, now)
    base = Path(settings.run_dir)
    if cutoff is None or not base.is_dir():
        return 0
    names = [p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
    removed = 0
    for start in range(0, len(names), 500):
        rows = session.scalars(
            select(Run).where(
                Run.uid.in_(names[start : start + 500]),
                Run.status.in_(ENDED),
                Run.finished_at < cutoff,
            )
        )
        for run in rows:
            if run.id in keep:
                continue
            try:
                directory = run_dir(settings, run)
            except ValueError:
                continue
            shutil.rmtree(directory, ignore_errors=True)
            removed += not directory.exists()
    return removed
