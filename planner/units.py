"""Byte sizes: parse "1.5TiB" / "80GB" / "1e9", format for people.

GiB means 2^30 and GB means 10^9, as everywhere in Headroom.
"""

from __future__ import annotations

import math
import re

from headroom.planner.errors import SpecError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

GIB = 2**30


def parse_size(value: str | int | float, *, field: str = "size") -> int:
    """Parse a byte size such as ``"1.5TiB"``, ``"80GB"`` or ``123456`` into integer bytes."""
    if isinstance(value, bool):
        raise SpecError(
            f"{field}: expected a size such as '80GiB' or '1.5TiB', got {value!r}", field=field
        )
    if isinstance(value, int | float):
        if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
            raise SpecError(f"{field}: must be a finite number >= 0, got {value!r}", field=field)
        return int(value)
    match = _SIZE_RE.match(value) if len(value) <= 64 else None
    if match is None or match.group(2).lower() not in _UNITS:
        allowed = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise SpecError(
            f"{field}: cannot read {value[:64]!r} as a size; use a number with one of {allowed}",
            field=field,
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):
        raise SpecError(f"{field}: {value!r} is too large a size", field=field)
    return int(size)


def format_bytes(num_bytes: int | float) -> str:
    """Format bytes in binary units with two decimals, e.g. ``'14.96 GiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} TiB"


def over_gpu(peak: int, margin: int, capacity: int) -> str:
    """Why a candidate was rejected for its GPU peak, in binary units."""
    return (
        f"GPU peak {format_bytes(peak)} + margin {format_bytes(margin)} > capacity "
        f"{format_bytes(capacity)}"
    )


def over_host(peak: int, capacity: int) -> str:
    """Why a candidate was rejected for its node's host RAM, in binary units."""
    return f"host RAM {format_bytes(peak)} > capacity {format_bytes(capacity)}"
