"""Numeric field types that refuse booleans.

pydantic's lax mode reads ``true`` as 1 for an ``int`` field and as 1.0 for a ``float`` one
(a bool is an int in Python), so ``num_layers: true`` was a 1-layer model and ``fraction: true``
offloaded everything. These types keep every other lax reading (``8.0`` and ``"8"`` are still 8)
and refuse a boolean with the field's name, as any other wrong type is refused.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


def _integer(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a boolean ({str(value).lower()})")
    return value


def _number(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a boolean ({str(value).lower()})")
    return value


#: the checks themselves, for a bounded number inside a union or a collection:
#: ``Annotated[int, Field(ge=1), INTEGER] | None``. The bounds come first there: after the check
#: pydantic still enforces them but writes them into the JSON schema as unknown keys ("ge"),
#: which generated clients and fuzzers ignore.
INTEGER = BeforeValidator(_integer)
NUMBER = BeforeValidator(_number)

Int = Annotated[int, INTEGER]
Float = Annotated[float, NUMBER]
