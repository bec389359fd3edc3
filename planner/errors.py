"""Errors raised for user mistakes.

    HeadroomError (ValueError)
    ├── SpecError          a model, training or hardware spec is invalid
    ├── UnknownPresetError a preset name matches no bundled file
    └── InputFormatError   a file cannot be read or is not JSON/YAML/config.json

Every message names the field (dotted path) and the allowed values, so the CLI can print it as
one line with exit code 2 and the API can return it as a 422 problem+json.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class HeadroomError(ValueError):
    """Base class of every user-facing error in Headroom."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SpecError(HeadroomError):
    """A model, training or hardware spec failed validation."""


class UnknownPresetError(HeadroomError):
    """A preset name did not match any bundled preset."""


class InputFormatError(HeadroomError):
    """A file could not be read or parsed."""


def did_you_mean(name: str, choices: Iterable[str] | Mapping[str, str]) -> str:
    """`` (did you mean 'X'?)`` for the choice closest to ``name`` (case aside), or ``""``; with
    a mapping, the keys are matched (aliases) and their values named (the canonical names)."""
    pairs = choices.items() if isinstance(choices, Mapping) else ((c, c) for c in choices)
    by_lower = {key.lower(): shown for key, shown in pairs}
    close = difflib.get_close_matches(name.strip().lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
