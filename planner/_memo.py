"""Memoisation keyed by object identity for the estimator's hot path.

Frozen pydantic models and large named tuples hash by value, which costs microseconds per call;
the estimator sees the same spec objects over and over (a ladder search, a service's parsed
presets). Arguments that are not plain scalars are keyed by ``id`` and kept alive in the entry,
so an id cannot be reused while its entry exists. Equal-but-distinct objects simply miss.
The leading ``objects`` arguments are keyed by identity; the rest must be hashable scalars,
passed by position.

Every cache here is shared by a service's threads, and none takes a lock: a hit is one
``dict.get`` and a miss computes, then inserts with ``BoundedDict.put``, whose eviction
tolerates another thread evicting or inserting at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, Protocol, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(dict[K, V]):
    """A dict that forgets its oldest entry when full: read it with ``get``, write it with
    ``put``. Both are safe from many threads without a lock: two threads evicting the same
    oldest entry, or one changing the dict while another finds its oldest key, is caught and
    the size checked again, so the dict stays consistent and within ``maxsize`` (give or take
    the inserts racing at that moment)."""

    __slots__ = ()

    def put(self, key: K, value: V, maxsize: int) -> V:
        """Insert ``key`` (evicting the oldest entries down to ``maxsize``) and return ``value``."""
        while self and len(self) >= maxsize and key not in self:
            try:
                del self[next(iter(self))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                continue
        self[key] = value
        return value


class Memoised(Protocol[P, R_co]):
    """A memoised function: called as the function it wraps, with ``cache_clear()``."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def cache_clear(self) -> None:
        """Forget every entry."""


def identity_memo(
    maxsize: int = 1024, objects: int = 1
) -> Callable[[Callable[P, R]], Memoised[P, R]]:
    """Cache a pure function's results by the identity of its first ``objects`` arguments and
    the values of the rest."""

    def decorate(fn: Callable[P, R]) -> Memoised[P, R]:
        # key -> (the arguments, kept alive so their ids stay unique; the value)
        cache: BoundedDict[tuple[object, ...], tuple[tuple[object, ...], R]] = BoundedDict()

        @wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if kwargs:
                raise TypeError(f"{fn.__name__}: memoised arguments are positional only")
            if objects == 1:
                key: tuple[object, ...] = (id(args[0]), *args[1:])
            elif objects == 2:
                key = (id(args[0]), id(args[1]), *args[2:])
            else:
                key = (*map(id, args[:objects]), *args[objects:])
            hit = cache.get(key)
            if hit is not None:
                return hit[1]
            return cache.put(key, (args, fn(*args, **kwargs)), maxsize)[1]

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        return cast(Memoised[P, R], wrapper)

    return decorate
