"""Memoisation keyed by object identity for the estimator's hot path.

Frozen pydantic models and large named tuples hash by value, which costs microseconds per call;
the estimator sees the same spec objects over and over (a ladder search, a service's parsed
presets). Arguments that are not plain scalars are keyed by ``id`` and kept alive in the entry,
so an id cannot be reused while its entry exists. Equal-but-distinct objects simply miss.
The leading ``objects`` arguments are keyed by identity; the rest must be hashable scalars.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

R = TypeVar("R")


def identity_memo(
    maxsize: int = 1024, objects: int = 1
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Cache a pure function's results by the identity of its first ``objects`` arguments and
    the values of the rest."""

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], R]] = {}

        @wraps(fn)
        def wrapper(*args: Any) -> R:
            if objects == 1:
                key: tuple[Any, ...] = (id(args[0]), *args[1:])
            else:
                key = (*map(id, args[:objects]), *args[objects:])
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
