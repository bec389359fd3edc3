"""Memoisation keyed by object identity for the estimator's hot path.

Frozen pydantic models and large named tuples hash by value, which costs microseconds per call;
the estimator sees the same spec objects over and over (a ladder search, a service's parsed
presets). Arguments that are not plain scalars are keyed by ``id`` and kept alive in the entry,
so an id cannot be reused while its entry exists. Equal-but-distinct objects simply miss.
The leading ``objects`` arguments are keyed by identity; the rest must be hashable scalars,
passed by position.

Every cache here is shared by a service's threads. A hit is one ``dict.get``, which needs no
lock; a miss computes outside any lock and only the insert (with its eviction) is serialised,
so two threads can never evict the same entry or iterate while another inserts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, Protocol, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(dict[K, V]):
    """A dict that forgets its oldest entry when full. Read it with ``get`` (lock-free);
    write it only with ``put`` and ``clear``, which hold its lock."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        super().__init__()
        # re-entrant: a finaliser run by the collector inside ``put`` may itself insert
        self._lock = threading.RLock()

    def put(self, key: K, value: V, maxsize: int) -> V:
        """Insert ``key`` (evicting the oldest entries down to ``maxsize``) and return ``value``."""
        with self._lock:
            if key not in self:
                while self and len(self) >= maxsize:
                    del self[next(iter(self))]
            self[key] = value
        return value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            super().clear()


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
