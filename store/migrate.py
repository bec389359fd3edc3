"""Database migrations, programmatically: upgrade to head, downgrade, check the revision, and
open a store migrated to the latest revision."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.orm import Session, sessionmaker

from headroom.store.engine import StoreSettings, make_engine, make_sessionmaker

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


def open_store(url: str | None = None) -> sessionmaker[Session]:
    """A sessionmaker on ``url`` (default: the configured ``HEADROOM_DATABASE_URL``), the
    database upgraded to the latest revision first."""
    url = url or StoreSettings().database_url
    upgrade(url)
    return make_sessionmaker(make_engine(url))
