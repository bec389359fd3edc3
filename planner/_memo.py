"""Memoisation keyed by object identity for the estimator's hot path.

Frozen pydantic models and large named tuples hash by value, which costs microseconds per call;
the estimator sees the same spec objects over and over (a ladder search, a service's parsed
presets). Arguments that are not plain scalars are keyed by ``id`` and kept alive in the entry,
so an id cannot be reused while its entry exists. Equal-but-distinct objects simply miss.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

R = TypeVar("R")
_SCALARS = frozenset({int, float, str, bool, type(None)})


def identity_memo(maxsize: int = 1024) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Cache a pure function's results by the identity of its object arguments."""

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], R]] = {}

        @wraps(fn)
        def wrapper(*args: Any) -> R:
            key = tuple([a if type(a) in _SCALARS else id(a) for a in args])
            hit = cache.get(key)
            if hit is not None:
                return hit[1]
            value = fn(*args)
            if len(cache) >= maxsize:
                del cache[next(iter(cache))]
            cache[key] = (args, value)
            return value

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
