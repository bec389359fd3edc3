"""Calibration records from GPU runs' own logs (``headroom calibrate ingest`` and
``POST /api/v1/calibrations/ingest``), and from the published runs.

Every log is read (``calibration.logs``) before anything is stored: one that cannot be read
refuses the whole ingest, naming its file and line, and nothing half-read is kept. Each log
becomes one record of the specs it ran (source ``log``), tagged with its GPU, framework and
activation profile, so that the trust of that stack (``calibration.stored.calibrated_for``)
learns from it. The published runs' file (``calibration/data/published-memory.json``) becomes
one record per run with a measured figure (source ``published``), each with its own specs; its
out-of-memory runs have no number to record and are counted apart.

A record's uid is a digest of what it was read from and the specs, so ingesting the same log
again finds the stored record instead of adding a second.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from headroom import planner, store
from headroom.calibration.logs import LogError, detect, published_measurement, read_log
from headroom.calibration.stored import record_measurement, stack_trust
from headroom.planner.measurement import Measurement
from headroom.store.calibrations import spec_dump

#: the stages a log's rank can be (``--stage``); None: the heaviest
STAGES = ("first", "last")


@dataclass(frozen=True)
class Item:
    """One record to store: what it was read from, its specs and its measurement."""

    name: str
    format: str
    model: planner.ModelSpec
    train: planner.TrainSpec
    hw: planner.Hardware
    measured: Measurement
    source: str
    uid: str
    notes: str


@dataclass(frozen=True)
class Ingest:
    """The records an ingest makes, and what it read but could not record."""

    items: tuple[Item, ...]
    skipped: tuple[dict[str, str], ...]


def _uid(prefix: str, *parts: Any) -> str:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"{prefix}-{digest[:40]}"


def read_logs(
    files: Sequence[tuple[str, bytes]],
    *,
    fmt: str | None = None,
    model: planner.ModelSpec | None = None,
    train: planner.TrainSpec | None = None,
    hw: planner.Hardware | None = None,
    stage: str | None = None,
) -> Ingest:
    """Read every file (``(name, content)``) into the records it makes, refusing the lot on the
    first that cannot be read. The specs are needed for a run's log, not for the published
    runs' file (whose runs carry their own)."""
    if stage is not None and stage not in STAGES:
        raise planner.SpecError(
            f"stage: unknown {stage!r}; allowed: {', '.join(STAGES)}", field="stage"
        )
    items: list[Item] = []
    skipped: list[dict[str, str]] = []
    if not files:
        raise LogError("logs: no log given")
    for name, data in files:
        found = fmt or detect(data, name)
        if found == "published":
            more, left = _published(data, name)
            items += more
            skipped += left
            continue
        if model is None or train is None or hw is None:
            raise planner.SpecError(
                f"model: {name} is a {found} log of one run; name the run's model, training "
                "spec and GPU (--model, --train, --gpu)",
                field="model",
            )
        reading = read_log(data, name, found)
        measured = reading.measurement()
        if stage is not None:
            measured = measured.model_copy(update={"stage": stage})
        specs = spec_dump(model=model, train=train, hw=hw)
        items.append(
            Item(
                name=name,
                format=reading.format,
                model=model,
                train=train,
                hw=hw,
                measured=measured,
                source="log",
                uid=_uid("log", reading.format, hashlib.sha256(data).hexdigest(), specs, stage),
                notes=f"{reading.format} log {name}",
            )
        )
    return Ingest(tuple(items), tuple(skipped))


def _published(data: bytes, name: str) -> tuple[list[Item], list[dict[str, str]]]:
    try:
        runs = json.loads(data)["runs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LogError(f"{name}: not the published runs' file ({exc})") from None
    if not isinstance(runs, list):
        raise LogError(f"{name}: not the published runs' file (runs is no list)")
    items, skipped = [], []
    for index, run in enumerate(runs):
        try:
            item = _published_run(run)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # specs' errors too
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise LogError(f"{name}: runs[{index}]: not a published run ({first})") from None
        if isinstance(item, Item):
            items.append(item)
        else:
            skipped.append(item)
    return items, skipped


def _published_run(run: dict[str, Any]) -> Item | dict[str, str]:
    """One published run as the record it makes, or why it makes none (an OOM, no number)."""
    from headroom.calibration.published import spec_of

    measured = published_measurement(run)
    if measured is None:
        return {"run": str(run.get("id")), "reason": f"figure {run.get('figure')}"}
    if run.get("measured_stage") in STAGES:
        measured = measured.model_copy(update={"stage": run["measured_stage"]})
    model, train, hw = spec_of(run)
    source = run.get("source") or {}
    url = source.get("url", "") if isinstance(source, dict) else str(source)
    return Item(
        name=str(run["id"]),
        format="published",
        model=model,
        train=train,
        hw=hw,
        measured=measured,
        source="published",
        uid=f"published-{run['id']}"[:64],
        notes=f"published run {run['id']}: {url}"[:4000],
    )


def store_items(session: Session, ingest: Ingest) -> list[dict[str, Any]]:
    """Store every item (each estimated and compared, ``record_measurement``) and return what
    each became: its uid, whether it was new, its figure and error."""
    out = []
    for item in ingest.items:
        row = store.calibration_by_uid(session=session, uid=item.uid)
        created = False
        if row is None:
            row, created = record_measurement(
                session=session,
                uid=item.uid,
                model=item.model,
                train=item.train,
                hw=item.hw,
                measured=item.measured,
                source=item.source,
                notes=item.notes,
            )
        comparison = row.predicted.get("comparison", {})
        out.append(
            {
                "name": item.name,
                "format": item.format,
                "uid": row.uid,
                "id": row.id,
                "created": created,
                "model": row.model_name,
                "gpu": row.gpu_name,
                "framework": row.framework,
                "activation_profile": row.activation_profile,
                "figure": comparison.get("figure", "max_allocated"),
                "measured_bytes": row.measured_peak_bytes,
                "predicted_bytes": row.predicted_peak_bytes,
                "relative_error": row.relative_error,
                "stage": item.measured.stage,
            }
        )
    return out


def stacks_trust(session: Session, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trust of each (GPU, framework, profile) the records belong to, as
    ``estimate --calibrated`` now judges it (``calibration.stored.stack_trust``)."""
    stacks = dict.fromkeys((r["gpu"], r["framework"], r["activation_profile"]) for r in records)
    return stack_trust(session, stacks)
