"""Calibration records, coefficient sets and runs. Writes need the bearer token.

Request bodies become domain objects here (validated specs, a ``Measurement``); calibration,
the launch layer and the store do the rest.
"""

from __future__ import annotations

import base64
import os
import re
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BeforeValidator, ValidationError

from headroom import launch, planner, store
from headroom.api import idempotency
from headroom.api.deps import MetricsDep, SessionDep, SettingsDep
from headroom.api.problems import problem, responses
from headroom.api.routing import single_valued_query
from headroom.api.schemas import (
    CalibrationIn,
    CalibrationOut,
    CoefficientSetOut,
    IngestIn,
    IngestOut,
    LogBase64,
    LogText,
    Page,
    RunIn,
    RunOut,
)
from headroom.api.security import TokenFirst, require_token
from headroom.api.settings import Settings
from headroom.calibration import ingest
from headroom.calibration.published import published_file
from headroom.calibration.stored import record_measurement
from headroom.launch.slurm import SlurmOverrides
from headroom.planner.measurement import Measurement
from headroom.planner.trainable import check_supported, trainer_profile
from headroom.store import Calibration, Run

#: every route here reads or writes the store: 503 (with Retry-After) while it is unavailable;
#: a write's token is checked before its body is read (TokenFirst)
router = APIRouter(
    dependencies=[Depends(single_valued_query)], responses=responses(503), route_class=TokenFirst
)


class NotFound(Exception):
    def __init__(self, what: str, row_id: int, why: str = "does not exist") -> None:
        super().__init__(f"{what} {row_id} {why}")


def _specs(
    body: CalibrationIn | RunIn | IngestIn,
) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware]:
    """The body's model, training spec and GPU, validated by the planner."""
    assert body.model is not None  # an ingest of the published runs names none: not asked
    model = planner.load_model(body.model)
    train = planner.load_train(body.train_of(model) or {})
    return model, train, planner.load_hardware(body.gpu)


def _allocation(body: RunIn) -> SlurmOverrides | None:
    """The run's own Slurm allocation (None: the settings'); a ``SpecError`` naming its field
    where it is invalid, or given for another backend."""
    if body.slurm is None:
        return None
    if body.backend != "slurm":
        raise planner.SpecError(
            f"slurm: an allocation is for backend slurm (got backend {body.backend})",
            field="slurm",
        )
    try:
        return SlurmOverrides.model_validate(body.slurm)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(["slurm", *(str(part) for part in first["loc"])])
        raise planner.SpecError(f"{name}: {first['msg']}", field=name) from None


def _calibration(row: Calibration) -> CalibrationOut:
    out = CalibrationOut.model_validate(row, from_attributes=True)
    return out.model_copy(update={"created_at": store.as_utc(row.created_at)})


def _run(row: Run) -> RunOut:
    out = RunOut.model_validate(row, from_attributes=True)
    return out.model_copy(
        update={
            name: store.as_utc(getattr(row, name))
            for name in ("created_at", "updated_at", "started_at", "finished_at")
        }
    )


def _decimal_id(value: Any) -> Any:
    """A path's id as written: digits with no sign, space, fraction or leading zero (an int
    parse read ``" 1"``, ``1.0``, ``+1`` and ``1_0`` as runs 1 and 10)."""
    if isinstance(value, str) and not re.fullmatch(r"[1-9][0-9]{0,9}", value):
        raise ValueError(
            f"{value[:40]!r} is no row id; allowed: 1 to {store.MAX_ROW_ID} in decimal digits, "
            "without a sign, spaces, a fraction or leading zeros"
        )
    return value


#: a row id: bounded by the id columns' range, so an id no row can have is the same 422 on
#: SQLite and PostgreSQL (whose 32-bit ``integer`` refused it with a 500), and written one way
RowId = Annotated[
    int,
    Path(
        ge=1,
        le=store.MAX_ROW_ID,
        description=f"The row's id, 1 to {store.MAX_ROW_ID} in decimal digits (any other "
        "text, or beyond that: 422).",
    ),
    BeforeValidator(_decimal_id),  # after the bounds, which the schema keeps (minimum, maximum)
]
Limit = Query(default=100, ge=1, le=500)
Offset = Query(default=0, ge=0, le=2**31)
#: filters are compared with text columns, and PostgreSQL refuses NUL in text
NO_NUL = r"^[^\x00]*$"


@router.get("/calibrations", tags=["calibration"], response_model=Page)
def list_calibrations(
    db: SessionDep,
    limit: int = Limit,
    offset: int = Offset,
    model: str | None = Query(default=None, max_length=200, pattern=NO_NUL),
    gpu: str | None = Query(default=None, max_length=100, pattern=NO_NUL),
) -> dict[str, Any]:
    rows, total = store.list_rows(
        session=db, table=Calibration, limit=limit, offset=offset, model_name=model, gpu_name=gpu
    )
    return {"items": [_calibration(r) for r in rows], "total": total}


#: a write under a client's uid: created, the same request again, or another one (409)
_WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Already stored under this uid from the same request"},
    **responses(401, 409, 413, 422),
}


@router.post(
    "/calibrations",
    tags=["calibration"],
    status_code=201,
    response_model=CalibrationOut,
    dependencies=[Depends(require_token)],
    responses=_WRITE_RESPONSES,
)
def add_calibration(
    body: CalibrationIn, db: SessionDep, metrics: MetricsDep, response: Response
) -> CalibrationOut:
    """Store a measurement with the estimate it is compared against. Idempotent on ``uid``:
    the same request again returns the stored record (200), another one under it is a 409
    (``api.idempotency``); an invalid body is a 422 whatever its uid names."""
    model, train, hw = _specs(body)
    measured = Measurement.model_validate(body.measured.model_dump())
    uid = body.uid or uuid.uuid4().hex
    row, created = store.calibration_by_uid(session=db, uid=uid), False
    if row is None:
        row, created = record_measurement(
            session=db,
            uid=uid,
            model=model,
            train=train,
            hw=hw,
            measured=measured,
            source=body.source,
            notes=body.notes,
        )
    if created:
        metrics.calibrations.inc()
        return _calibration(row)
    asked = idempotency.calibration_request(
        model=model, train=train, hw=hw, measured=measured, source=body.source, notes=body.notes
    )
    stored = idempotency.stored_calibration_request(row)
    idempotency.check_retry("calibration record", row, stored, asked)
    response.status_code = 200
    return _calibration(row)


@router.post(
    "/calibrations/ingest",
    tags=["calibration"],
    status_code=201,
    response_model=IngestOut,
    dependencies=[Depends(require_token)],
    responses={200: {"description": "Every record was already stored"}, **responses(401, 413, 422)},
)
def ingest_calibrations(
    body: IngestIn, db: SessionDep, metrics: MetricsDep, response: Response
) -> dict[str, Any]:
    """Read GPU runs' logs (Megatron-LM, torchtitan, DeepSpeed, HF Trainer, Accelerate,
    nvidia-smi CSV, a memory snapshot) into calibration records of the stack they ran on, as
    ``headroom calibrate ingest`` does, and return each record and that stack's trust. Every
    log is read before anything is stored: one that cannot be read is a 422 naming it and its
    line, and nothing is stored. Ingesting the same log again finds its record (200)."""
    files = [
        (log.name, log.text.encode() if isinstance(log, LogText) else _decoded(log))
        for log in body.logs
    ]
    if body.published:
        files.append(("published-memory.json", published_file()))
    specs: tuple[Any, ...] = _specs(body) if body.model is not None else (None, None, None)
    read = ingest.read_logs(
        files, fmt=body.format, model=specs[0], train=specs[1], hw=specs[2], stage=body.stage
    )
    records = ingest.store_items(db, read)
    created = sum(r["created"] for r in records)
    if created:
        metrics.calibrations.inc(created)
    else:
        response.status_code = 200
    return {
        "records": records,
        "skipped": list(read.skipped),
        "trust": ingest.stacks_trust(db, records),
        "warnings": body.train_warnings(),
    }


def _decoded(log: LogBase64) -> bytes:
    try:
        return base64.b64decode(log.base64, validate=True)
    except ValueError:
        raise planner.InputFormatError(
            f"logs: {log.name[:100]!r}: base64 is not valid base64", field="logs"
        ) from None


@router.get(
    "/calibrations/{calibration_id:rowid}",
    tags=["calibration"],
    response_model=CalibrationOut,
    responses=responses(404),
)
def get_calibration(calibration_id: RowId, db: SessionDep) -> CalibrationOut:
    row = store.get_row(session=db, table=Calibration, row_id=calibration_id)
    if row is None:
        raise NotFound("calibration", calibration_id)
    return _calibration(row)


@router.get("/coefficients", tags=["calibration"], response_model=list[CoefficientSetOut])
def coefficients(db: SessionDep) -> list[dict[str, Any]]:
    """Shipped coefficient sets per activation profile, and the fitted ones in the store, each
    with the trust its profile's stacks have earned (``trust``: per GPU and framework with
    records, as ``estimate --calibrated`` judges them)."""
    from headroom.calibration.stored import stack_trust, stacks

    trust = stack_trust(db, stacks(session=db))
    sets = store.coefficient_sets(session=db)
    for entry in sets:
        entry["trust"] = [
            t
            for t in trust
            if t["activation_profile"] == entry["profile"]
            and (entry["device"] is None or t["gpu"] == entry["device"])
        ]
    return sets


@router.post(
    "/runs",
    tags=["runs"],
    status_code=201,
    response_model=RunOut,
    dependencies=[Depends(require_token)],
    responses=_WRITE_RESPONSES,
)
def add_run(body: RunIn, db: SessionDep, response: Response) -> RunOut:
    """Queue a run of the bundled trainer (validated by the planner first).

    With ``fit`` (the default) the ladder chooses the plan; without it the given spec must be
    predicted to fit, as the CI gate would decide. Either way nothing that is predicted to run
    out of memory is queued: the refusal is a 422 naming the field. Idempotent on ``uid``: the
    same request again returns the stored run (200, planned as it was then), another one under
    it is a 409 (``api.idempotency``); an invalid body is a 422 whatever its uid names."""
    allocation = _allocation(body)
    model, train, hw = _specs(body)
    check_supported(model)  # what the bundled trainer cannot build is no run at all
    train = trainer_profile(train)  # priced by the bundled trainer's own profile
    asked = idempotency.run_request(
        model=model,
        train=train,
        hw=hw,
        steps=body.steps,
        backend=body.backend,
        slurm=allocation,
        fit=body.fit,
        probe=body.probe,
    )
    uid = body.uid or uuid.uuid4().hex
    row, created = store.run_by_uid(session=db, uid=uid), False
    if row is None:
        plan = launch.plan_run(model=model, train=train, hw=hw, fit=body.fit)
        row, created = launch.queue_run(
            session=db,
            plan=plan,
            steps=body.steps,
            backend=body.backend,
            gate=not body.fit,
            probe=body.probe,
            uid=uid,
            slurm=allocation.model_dump(exclude_none=True) if allocation is not None else None,
            request=asked,
        )
    if not created:
        idempotency.check_retry("run", row, idempotency.stored_run_request(row), asked)
        response.status_code = 200
    return _run(row)


@router.get("/runs", tags=["runs"], response_model=Page)
def list_runs(
    db: SessionDep,
    limit: int = Limit,
    offset: int = Offset,
    status: str | None = Query(default=None, max_length=16, pattern=NO_NUL),
) -> dict[str, Any]:
    rows, total = store.list_rows(session=db, table=Run, limit=limit, offset=offset, status=status)
    return {"items": [_run(r) for r in rows], "total": total}


@router.get("/runs/{run_id}", tags=["runs"], response_model=RunOut, responses=responses(404))
def get_run(run_id: RowId, db: SessionDep) -> RunOut:
    row = store.get_row(session=db, table=Run, row_id=run_id)
    if row is None:
        raise NotFound("run", run_id)
    return _run(row)


#: most bytes of a run's log one request returns (a log grows to hundreds of MiB: it is read
#: in pieces, never whole)
MAX_LOG_PIECE_BYTES = 1 << 20
#: bytes read from a log and sent at a time
LOG_CHUNK_BYTES = 64 << 10
LOG_MEDIA_TYPE = "text/plain; charset=utf-8"
_LOG_HEADERS = {
    "X-Log-Size": {
        "description": "The log's size in bytes when it was read.",
        "schema": {"type": "integer"},
    },
    "X-Next-Offset": {
        "description": "Where the next piece starts: `offset` plus the bytes returned. Equal "
        "to X-Log-Size: the log's end, for now (a running run's log grows).",
        "schema": {"type": "integer"},
    },
}


def _chunks(log: BinaryIO, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``log`` from where it stands, a chunk at a time; closes it (the
    response owns the open log: retention may remove the file meanwhile)."""
    with log:
        while size > 0 and (chunk := log.read(min(size, LOG_CHUNK_BYTES))):
            size -= len(chunk)
            yield chunk


@router.get(
    "/runs/{run_id}/logs",
    tags=["runs"],
    response_class=PlainTextResponse,
    responses={
        200: {"description": "A piece of the log: its bytes as written", "headers": _LOG_HEADERS},
        **responses(404, 410, 416),
    },
)
def run_logs(
    run_id: RowId,
    db: SessionDep,
    settings: SettingsDep,
    offset: int = Query(
        default=0,
        ge=0,
        le=2**62,
        description="The byte of the log the piece starts at. At the log's end the piece is "
        "empty; past it, 416.",
    ),
    limit: int = Query(
        default=MAX_LOG_PIECE_BYTES,
        ge=1,
        le=MAX_LOG_PIECE_BYTES,
        description=f"Most bytes the piece holds (at most {MAX_LOG_PIECE_BYTES}).",
    ),
) -> Response:
    """The run's captured output (empty until it starts; 410 once retention removed it), a
    piece at a time: at most ``limit`` bytes from byte ``offset``, as written (UTF-8 text; a
    piece may end inside a character, so join pieces as bytes). Read the rest from
    ``X-Next-Offset``; ``X-Log-Size`` is the whole log's size."""
    row = store.get_row(session=db, table=Run, row_id=run_id)
    if row is None:
        raise NotFound("run", run_id)
    log = _open_log(settings, row)
    size = os.fstat(log.fileno()).st_size if log is not None else 0
    length = max(0, min(limit, size - offset))
    headers = {"X-Log-Size": str(size), "X-Next-Offset": str(offset + length)}
    if log is None or length == 0:
        if log is not None:
            log.close()
        if offset > size:
            return problem(
                416,
                f"offset: {offset} is past the end of the log ({size} bytes); allowed: 0 to {size}",
                field="offset",
                headers={"Content-Range": f"bytes */{size}", "X-Log-Size": str(size)},
            )
        return Response(b"", media_type=LOG_MEDIA_TYPE, headers=headers)
    log.seek(offset)
    headers["Content-Length"] = str(length)
    return StreamingResponse(_chunks(log, length), media_type=LOG_MEDIA_TYPE, headers=headers)


def _open_log(settings: Settings, row: Run) -> BinaryIO | None:
    """The run's log, open for reading (None: it has none yet); 404 for a stored path outside
    RUN_DIR, 410 for a log that retention removed."""
    if not row.log_path:
        return None
    try:  # the stored path is trusted only inside RUN_DIR (a row may predate the uid checks)
        log_path = launch.inside_run_dir(settings, row.log_path)
    except ValueError:
        raise NotFound("run", row.id, "has no log inside the run directory") from None
    try:
        return open(log_path, "rb")
    except FileNotFoundError:
        if launch.removed_by_retention(settings, row):
            days = settings.run_retention_days
            raise HTTPException(
                410,
                f"the log of run {row.id} was removed: its directory is kept {days:g} day(s) "
                "after the run ends (HEADROOM_RUN_RETENTION_DAYS)",
            ) from None
        return None


@router.post(
    "/runs/{run_id}/cancel",
    tags=["runs"],
    response_model=RunOut,
    dependencies=[Depends(require_token)],
    responses=responses(401, 404),
)
def cancel_run(run_id: RowId, db: SessionDep) -> RunOut:
    row = store.get_row(session=db, table=Run, row_id=run_id)
    if row is None:
        raise NotFound("run", run_id)
    return _run(launch.cancel(db, row))
