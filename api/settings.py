"""The service's settings: one class, read from ``HEADROOM_*`` environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from headroom.launch import LaunchSettings


class Settings(LaunchSettings):
    """Everything the service reads from its environment (prefix ``HEADROOM_``): the store's
    ``database_url``, the launch layer's ``run_dir``, ``run_device`` and ``max_running``, and the
    service's own settings."""

    token: SecretStr | None = Field(
        default=None,
        description="Bearer token for mutating endpoints; without one they are refused.",
    )
    require_token_for_reads: bool = Field(
        default=False,
        description="Reads of stored records (calibrations, coefficients, runs and their logs) "
        "need the bearer token too; needs a token.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest accepted request body (413 above)."
    )
    max_list: int = Field(default=500, ge=1, description="Most rows one list request returns.")
    search_queue: int = Field(
        default=8,
        ge=0,
        le=1000,
        description="Plan and fit searches that may wait for the search thread (one runs at a "
        "time; a client waits at most about this many searches' time); one more is refused "
        "with a 503 and Retry-After.",
    )
    search_deadline_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Longest a plan or fit search runs once it has started; past it the search "
        "stops and the request gets a 503 with Retry-After (the service was too busy: the "
        "searches' own budget keeps each far shorter on an idle machine).",
    )
    head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Seconds a client has to send a request's head (request line and header "
        "fields), from the connection's start or the head's first byte; past it the connection "
        "is closed (after a 408 if part of a head came).",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a client has to send a request's whole body once its head is in; "
        "past it 408 and the connection is closed.",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="Connections one server process holds at once; a connection past them is "
        "answered 503 and closed as it opens. Keep it under the process's open-file limit.",
    )
    launch_runs: bool = Field(
        default=True, description="Supervise queued runs: launch, watch, finish, reconcile."
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

    @field_validator("require_token_for_reads")
    @classmethod
    def _reads_need_a_token_to_check(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("token") is None:
            raise ValueError("needs HEADROOM_TOKEN to be set as well (else nothing could read)")
        return value
