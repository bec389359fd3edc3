"""Database migrations, programmatically: upgrade to head, downgrade, and check the revision."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from headroom.api.db import make_engine

SCRIPT_LOCATION = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def revision_of(connection: Connection) -> str | None:
    """The revision the database behind ``connection`` is at (None: never migrated)."""
    return MigrationContext.configure(connection).get_current_revision()


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return revision_of(connection)
    finally:
        engine.dispose()
