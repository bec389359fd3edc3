"""Writes under a client's ``uid``: a retry of the request is answered with the stored record,
another request under that uid is a conflict (409).

A client names a calibration record or a run with its own ``uid`` so that a retry after a lost
answer stores nothing twice. "The same request" is what the body asks for once validated, as
JSON: the model, training spec and GPU the planner reads from it (a preset by name or the same
spec as an object, ``train`` left out or ``{}``, a GPU by an alias: each the same), and the
body's other fields with their defaults (a calibration's measurement, source and notes; a run's
steps, backend, Slurm allocation, ``fit`` and ``probe``). Key order, whitespace and the way a
number is written do not matter. The stored side is read through today's types, so a key a
spec gained since (with its default) does not turn a retry into a conflict.

A calibration record keeps all of its request (specs, measurement, source, notes). A run keeps
it in ``runs.request``; one queued before that column (or by ``headroom launch``) is compared
with what its plan kept: everything but a training spec the ladder or the probes replaced.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import BaseModel, ValidationError

from headroom import planner, store
from headroom.launch.slurm import SlurmOverrides
from headroom.planner.measurement import Measurement
from headroom.store import Calibration, Run

#: the parts of a request that are validated types, each read through its type
_TYPED: dict[str, type[BaseModel]] = {
    "model": planner.ModelSpec,
    "train": planner.TrainSpec,
    "hardware": planner.Hardware,
    "measured": Measurement,
}
#: most differences a conflict names (the rest are counted)
MAX_NAMED = 5


class UidConflict(Exception):
    """A write under a uid that names a record stored from another request (409)."""

    def __init__(self, what: str, uid: str, row_id: int, differs: list[str]) -> None:
        named = ", ".join(differs[:MAX_NAMED])
        if len(differs) > MAX_NAMED:
            named += f" and {len(differs) - MAX_NAMED} more"
        super().__init__(
            f"uid: {uid!r} names {what} {row_id}, stored from another request (it differs in "
            f"{named}); post this one under a new uid, or the stored request again to get its "
            "record"
        )
        self.uid = uid
        self.differs = differs


def _canonical(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with its typed parts read through today's types (a part that no longer
    validates is kept as stored: it differs from any valid request)."""
    out = dict(request)
    for key, kind in _TYPED.items():
        if out.get(key) is not None:
            with contextlib.suppress(ValidationError):
                out[key] = kind.model_validate(out[key]).model_dump(mode="json")
    if out.get("backend") == "slurm":
        # no allocation of its own is the allocation of every default
        with contextlib.suppress(ValidationError):
            allocation = SlurmOverrides.model_validate(out.get("slurm") or {})
            out["slurm"] = allocation.model_dump(mode="json", exclude_none=True)
    return out


def calibration_request(
    *,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    measured: Measurement,
    source: str,
    notes: str,
) -> dict[str, Any]:
    """What a calibration body asks to be stored, canonical."""
    return _canonical(
        {
            **store.spec_dump(model=model, train=train, hw=hw),
            "measured": measured.model_dump(mode="json"),
            "source": source,
            "notes": notes,
        }
    )


def stored_calibration_request(row: Calibration) -> dict[str, Any]:
    """The request ``row`` was stored from, canonical: a record keeps all of it."""
    return _canonical(
        {**row.spec, "measured": row.measured, "source": row.source, "notes": row.notes}
    )


def run_request(
    *,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hw: planner.Hardware,
    steps: int,
    backend: str,
    slurm: SlurmOverrides | None,
    fit: bool,
    probe: bool,
) -> dict[str, Any]:
    """What a run body asks to be queued, canonical (``runs.request`` keeps it)."""
    return _canonical(
        {
            **store.spec_dump(model=model, train=train, hw=hw),
            "steps": steps,
            "backend": backend,
            "slurm": slurm.model_dump(mode="json", exclude_none=True) if slurm else None,
            "fit": fit,
            "probe": probe,
        }
    )


def stored_run_request(row: Run) -> dict[str, Any]:
    """The request ``row`` was queued from, canonical; for a run queued before runs kept it,
    what its plan kept of it (its training spec only where nothing replaced it)."""
    if row.request is not None:
        return _canonical(row.request)
    plan = row.plan
    kept = {
        "model": plan.get("model"),
        "hardware": plan.get("hardware"),
        "steps": row.steps,
        "backend": row.backend,
        "slurm": plan.get("slurm"),
        "fit": "fit" in plan,  # the ladder's plans keep what it weighed
        "probe": bool(plan.get("probe")),
    }
    if "fit" not in plan and "probes" not in plan:  # gated as given: the spec asked for
        kept["train"] = plan.get("train")
    return _canonical(kept)


def differences(stored: Any, asked: Any, path: str = "") -> list[str]:
    """Where ``asked`` differs from ``stored``, as dotted paths: at the top, in the parts
    ``stored`` kept; below, in any key."""
    if isinstance(stored, dict) and isinstance(asked, dict):
        keys = list(stored) if not path else sorted(set(stored) | set(asked), key=str)
        found: list[str] = []
        for key in keys:
            found += differences(stored.get(key), asked.get(key), f"{path}{key}.")
        return found
    same = type(stored) is type(asked) and stored == asked
    return [] if same else [path.rstrip(".")]


def check_retry(
    what: str, row: Calibration | Run, stored: dict[str, Any], asked: dict[str, Any]
) -> None:
    """Nothing if ``asked`` is the request ``row`` was stored from; else ``UidConflict``."""
    differs = differences(stored, asked)
    if differs:
        raise UidConflict(what, row.uid, row.id, differs)
