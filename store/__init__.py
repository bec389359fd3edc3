"""Headroom's store: the tables, engines and record functions below the service and calibration.

SQLAlchemy 2 on SQLite or PostgreSQL, migrated by Alembic (``headroom.migrations``). Record
functions take keyword arguments of domain types (planner specs, ``Measurement``), never a
service request body::

    from headroom import store
    sessions = store.open_store()  # HEADROOM_DATABASE_URL, upgraded to the latest revision
    with sessions() as session:
        row, created = store.add_calibration(session=session, uid=..., model=..., ...)

Imports the planner and SQLAlchemy only.
"""

from headroom.store.calibrations import (
    MAX_BIGINT,
    active_coefficients,
    add_calibration,
    all_calibrations,
    calibration_by_uid,
    coefficient_sets,
    recent_calibrations,
    save_coefficient_set,
    spec_dump,
)
from headroom.store.engine import (
    UNAVAILABLE_ERRORS,
    StoreSettings,
    make_engine,
    make_sessionmaker,
    unavailable,
)
from headroom.store.migrate import (
    current_revision,
    downgrade,
    head_revision,
    open_store,
    revision_of,
    upgrade,
)
from headroom.store.rows import get_row, list_rows
from headroom.store.runs import (
    RUN_UID_PATTERN,
    RUN_UID_RULE,
    add_run,
    check_run_uid,
    run_by_uid,
)
from headroom.store.tables import (
    MAX_ROW_ID,
    RUN_STATUSES,
    Base,
    Calibration,
    CoefficientSet,
    Run,
    as_utc,
    utcnow,
)

__all__ = [
    "MAX_BIGINT",
    "MAX_ROW_ID",
    "RUN_STATUSES",
    "RUN_UID_PATTERN",
    "RUN_UID_RULE",
    "UNAVAILABLE_ERRORS",
    "Base",
    "Calibration",
    "CoefficientSet",
    "Run",
    "StoreSettings",
    "active_coefficients",
    "add_calibration",
    "add_run",
    "all_calibrations",
    "as_utc",
    "calibration_by_uid",
    "check_run_uid",
    "coefficient_sets",
    "current_revision",
    "downgrade",
    "get_row",
    "head_revision",
    "list_rows",
    "make_engine",
    "make_sessionmaker",
    "open_store",
    "recent_calibrations",
    "revision_of",
    "run_by_uid",
    "save_coefficient_set",
    "spec_dump",
    "unavailable",
    "upgrade",
    "utcnow",
]
