"""The service's settings: one class, read from ``HEADROOM_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from headroom.store import StoreSettings


class Settings(StoreSettings):
    """Everything the service reads from its environment (prefix ``HEADROOM_``): the store's
    ``database_url`` and the service's own settings."""

    token: SecretStr | None = Field(
        default=None,
        description="Bearer token for mutating endpoints; without one they are refused.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest accepted request body (413 above)."
    )
    max_list: int = Field(default=500, ge=1, description="Most rows one list request returns.")
    run_dir: Path = Field(default=Path("runs"), description="Where launched runs keep their logs.")
    launch_runs: bool = Field(
        default=True, description="Supervise queued runs: launch, watch, finish, reconcile."
    )
    run_device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where launched runs train (auto: cuda when NVML sees one)."
    )
    max_running: int = Field(
        default=1, ge=1, le=64, description="Runs one service process trains at a time."
    )
    migrate: bool = Field(
        default=True, description="Upgrade the database to the latest migration on start."
    )

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        # HEADROOM_TOKEN="" must not count as a configured (and trivially guessed) token
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return value
