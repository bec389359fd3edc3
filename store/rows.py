"""Reading rows, and writing them once: the helpers every record function shares.

Writes are idempotent on a client-chosen ``uid``, so a client that retries after a lost
response (a restart, a timeout) never creates a duplicate and never loses a record.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from headroom.store.tables import Calibration, Run

Row = TypeVar("Row", Calibration, Run)


def by_uid(*, session: Session, table: type[Row], uid: str) -> Row | None:
    """The row of ``table`` stored under ``uid`` (None: there is none)."""
    return session.scalar(select(table).where(table.uid == uid))


def insert_once(*, session: Session, row: Row) -> tuple[Row, bool]:
    """Commit ``row``; if its uid was committed concurrently, return that one instead."""
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        existing = by_uid(session=session, table=type(row), uid=row.uid)
        if existing is None:
            raise
        return existing, False
    return row, True


def list_rows(
    *, session: Session, table: type[Any], limit: int, offset: int, **filters: Any
) -> tuple[list[Any], int]:
    """One page of ``table`` by id, and how many rows match ``filters`` (None: any)."""
    query = select(table)
    count = select(func.count()).select_from(table)
    for column, value in filters.items():
        if value is not None:
            query = query.where(getattr(table, column) == value)
            count = count.where(getattr(table, column) == value)
    rows = list(session.scalars(query.order_by(table.id).limit(limit).offset(offset)))
    return rows, int(session.scalar(count) or 0)


def get_row(*, session: Session, table: type[Any], row_id: int) -> Any:
    return session.get(table, row_id)
