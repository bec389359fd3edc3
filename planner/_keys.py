"""Objects with many unknown keys are refused at once, not key by key.

Input models refuse unknown keys (``extra="forbid"``), and pydantic makes one error per unknown
key: an object with 50,000 of them cost ~0.3 s of CPU to refuse (the errors, then their
conversion for the message), whatever else the request held, while its JSON took 30 ms to
read. A model built on ``FewUnknownKeys`` counts its input's keys first: up to
``MAX_UNKNOWN_KEYS`` unknown ones are refused as before, each named; more are refused with one
error that names a few and counts the rest, before any key is validated.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator, model_validator
from pydantic_core import PydanticCustomError

#: unknown keys in one object that are still refused one by one (the service lists 20 errors)
MAX_UNKNOWN_KEYS = 20
#: unknown keys the one error names
_NAMED = 5


def at_most(limit: int, what: str) -> BeforeValidator:
    """Refuse a list (or object) of more than ``limit`` ``what`` before its items are validated
    (each bad item would be an error of its own)."""

    def check(value: Any) -> Any:
        if isinstance(value, list | tuple | dict) and len(value) > limit:
            raise ValueError(f"at most {limit} {what}, got {len(value)}")
        return value

    return BeforeValidator(check)


def _shown(key: object) -> str:
    text = repr(key)
    return text if len(text) <= 40 else f"{text[:39]}…"


class FewUnknownKeys(BaseModel):
    """A model whose input object may hold at most ``MAX_UNKNOWN_KEYS`` unknown keys (more are
    one error, naming the allowed ones)."""

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_keys(cls, data: Any) -> Any:
        fields = cls.__pydantic_fields__
        if not isinstance(data, dict) or len(data) <= len(fields) + MAX_UNKNOWN_KEYS:
            return data  # too few keys to hold that many unknown ones
        unknown = [key for key in data if key not in fields]
        if len(unknown) <= MAX_UNKNOWN_KEYS:
            return data
        raise PydanticCustomError(
            "too_many_unknown_keys",
            "{count} unknown fields ({named}, …); allowed: {allowed}",
            {
                "count": len(unknown),
                "named": ", ".join(_shown(key) for key in unknown[:_NAMED]),
                "allowed": ", ".join(fields),
            },
        )
