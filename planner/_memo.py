"""Bounded memoisation for the estimator's hot path, keyed by object identity.

Frozen pydantic models and large named tuples hash by value, which costs microseconds per call;
the estimator sees the same spec objects over and over (a ladder search, a service's parsed
presets). Arguments that are not plain scalars are keyed by ``id`` and kept alive in the entry,
so an id cannot be reused while its entry exists. Equal-but-distinct objects simply miss.
The leading ``objects`` arguments are keyed by identity; the rest must be hashable scalars,
passed by position.

Every cache is bounded twice: in entries, and in the bytes its entries keep alive. Each entry
is put with its weight, an upper bound of those bytes (the spec it keeps alive, a stage's list
of layer kinds, a backward's points), so a service that is sent thousands of distinct
4,096-layer models holds at most ``maxbytes`` per cache whatever they are
(``tests/planner/test_cache_bounds.py`` holds the weights to what ``tracemalloc`` sees).

Every cache here is shared by a service's threads. A hit takes no lock: it is one ``dict.get``.
A miss computes without a lock, then ``BoundedDict.put`` inserts and evicts under the cache's
lock (a few dictionary operations), so the weights always add up.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import wraps
from typing import Any, ParamSpec, Protocol, TypeVar, cast

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
K = TypeVar("K")
V = TypeVar("V")

#: the weight of an entry that keeps only small objects alive (a few named tuples of numbers)
SMALL_ENTRY_BYTES = 2048


class BoundedDict(dict[K, V]):
    """A dict that forgets its oldest entries beyond ``maxsize`` entries or ``maxbytes`` of
    their weights: read it with ``get`` (no lock), write it with ``put``. An entry heavier than
    ``maxbytes`` on its own is not kept."""

    __slots__ = ("__weakref__", "_lock", "_weights", "held_bytes", "maxbytes", "maxsize")

    def __init__(self, maxsize: int, maxbytes: int) -> None:
        super().__init__()
        self.maxsize, self.maxbytes = maxsize, maxbytes
        self.held_bytes = 0  # the weights of the entries held
        self._weights: dict[K, int] = {}
        self._lock = threading.Lock()
        _CACHES[id(self)] = self

    def put(self, key: K, value: V, nbytes: int) -> V:
        """Insert ``key`` weighing ``nbytes`` (evicting the oldest entries down to both bounds)
        and return ``value``."""
        if nbytes > self.maxbytes:
            return value
        with self._lock:
            self.held_bytes += nbytes - self._weights.get(key, 0)
            self._weights[key] = nbytes
            self[key] = value
            while len(self) > self.maxsize or self.held_bytes > self.maxbytes:
                oldest = next(iter(self))
                del self[oldest]
                self.held_bytes -= self._weights.pop(oldest)
        return value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            super().clear()
            self._weights.clear()
            self.held_bytes = 0


_CACHES: weakref.WeakValueDictionary[int, BoundedDict[Any, Any]] = weakref.WeakValueDictionary()


def caches() -> list[BoundedDict[Any, Any]]:
    """Every bounded cache alive (the planner's are for the process's life)."""
    return list(_CACHES.values())


class Memoised(Protocol[P, R_co]):
    """A memoised function: called as the function it wraps, with ``cache_clear()`` and the
    ``cache`` it fills."""

    cache: BoundedDict[tuple[object, ...], tuple[tuple[object, ...], object]]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def cache_clear(self) -> None:
        """Forget every entry."""


def identity_memo(
    maxsize: int,
    maxbytes: int,
    objects: int = 1,
    nbytes: Callable[..., int] | None = None,
) -> Callable[[Callable[P, R]], Memoised[P, R]]:
    """Cache a pure function's results by the identity of its first ``objects`` arguments and
    the values of the rest. ``nbytes(*args)`` weighs an entry (what the arguments it keeps alive
    and the result hold); without it an entry weighs ``SMALL_ENTRY_BYTES``."""

    def decorate(fn: Callable[P, R]) -> Memoised[P, R]:
        # key -> (the arguments, kept alive so their ids stay unique; the value)
        cache: BoundedDict[tuple[object, ...], tuple[tuple[object, ...], R]] = BoundedDict(
            maxsize, maxbytes
        )

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
            weight = SMALL_ENTRY_BYTES if nbytes is None else nbytes(*args)
            return cache.put(key, (args, fn(*args, **kwargs)), weight)[1]

        wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
        wrapper.cache = cache  # type: ignore[attr-defined]
        return cast(Memoised[P, R], wrapper)

    return decorate
