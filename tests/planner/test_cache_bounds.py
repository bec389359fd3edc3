"""The planner's caches keep at most their stated bytes, whatever they are sent.

A service parses every custom model a request brings, and the identity-keyed caches keep each
parsed spec alive with its terms. Each cache entry once held a unit per layer: a 4,096-layer
model kept ~10 MB, and 575 distinct ones took a server from 237 MB to 2.9 GB. Every cache now
counts the bytes its entries keep alive (``planner._memo``) and forgets its oldest beyond its
bound; ``tracemalloc`` checks here that the weights it counts cover what is really kept.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from bench_modules import bench_module

from headroom import planner
from headroom.planner import _memo
from headroom.planner.coefficients import _default_coefficients

#: what the planner's caches may hold together (docs/PERFORMANCE.md)
BUDGET_BYTES = 58 << 20
#: what a run of estimates keeps that is no cache's (interpreter and library internals)
SLACK_BYTES = 2 << 20


def _deep_model(i: int) -> dict[str, Any]:
    """A distinct 4,096-layer MoE model as heavy as the schema lets it be: the service bench's,
    256 layers forced dense at random (each breaks the layer pattern), with the longest source
    text."""
    return dict(bench_module("api_cost").deep_model(i, source="s" * 4000))


@pytest.fixture
def traced() -> Iterator[None]:
    for cache in _memo.caches():
        cache.clear()
    gc.collect()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        for cache in _memo.caches():
            cache.clear()


def _held() -> int:
    return sum(cache.held_bytes for cache in _memo.caches())


def _run(models: int, fits: int) -> None:
    hw = planner.gpu("H100-80GB")
    for i in range(models):
        model = planner.load_model(_deep_model(i))
        spec = {"micro_batch_size": 1 + i % 4, "recompute": ["none", {"every_k": 4}][i % 2]}
        if i % 3 == 0:
            spec["parallel"] = {"pp": 2, "dp": 2}
        planner.estimate(model, planner.load_train(spec), hw).model_dump()
        if i < fits:
            planner.fit(model, planner.load_train({"micro_batch_size": 64}), hw)


def test_every_cache_is_bounded_in_bytes() -> None:
    caches = _memo.caches()
    assert len(caches) >= 10
    assert all(cache.maxbytes > 0 for cache in caches)
    assert sum(cache.maxbytes for cache in caches) <= BUDGET_BYTES


def test_many_distinct_4096_layer_models_stay_within_the_budget(traced: None) -> None:
    """More models than the bounds hold: the oldest are forgotten, each cache stays within its
    bound, and what the estimates keep is within what the caches count (so within the
    budget)."""
    start = tracemalloc.get_traced_memory()[0]
    _run(models=40, fits=2)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - start
    caches = _memo.caches()
    assert all(cache.held_bytes <= cache.maxbytes for cache in caches)
    assert sum(cache.held_bytes > cache.maxbytes * 0.9 for cache in caches) >= 2  # evicting
    assert 1 << 20 < kept <= _held() + SLACK_BYTES, (kept, _held())
    assert _held() <= BUDGET_BYTES


def test_gpu_names_do_not_grow_the_coefficients_memo() -> None:
    """Any GPU name was a new entry of an unbounded memo; only shipped device names are kept
    (a name without a set of its own gets the generic set)."""
    generic = planner.default_coefficients("textbook")
    for i in range(2000):
        assert planner.default_coefficients("textbook", f"gpu-{i}") is generic
    assert _default_coefficients.cache_info().currsize <= 4 * len(planner.profiles())
