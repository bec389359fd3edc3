"""The planner's caches are safe to call from many threads (a service's thread pool).

Eviction used to be ``del cache[next(iter(cache))]`` on a shared dict: two threads evicting at
once gave ``KeyError`` or "dictionary changed size during iteration". The caches are shrunk to a
few entries here so that every miss evicts, and the interpreter switches threads as often as it
can, so a race shows within a few seconds; the bytes a cache counts must still be those of the
entries it holds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from headroom import planner
from headroom.planner import estimator
from headroom.planner._memo import SMALL_ENTRY_BYTES, identity_memo

THREADS = 8
SECONDS = 3.0


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _hammer(work: Callable[[int, int], None], seconds: float = SECONDS) -> list[BaseException]:
    """Run ``work(thread, iteration)`` on THREADS threads for ``seconds``; the errors raised."""
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds
    start = threading.Barrier(THREADS)

    def run(thread: int) -> None:
        start.wait()
        i = 0
        try:
            while time.monotonic() < deadline and not errors:
                work(thread, i)
                i += 1
        except BaseException as err:  # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_identity_memo_evicts_safely_from_many_threads() -> None:
    @identity_memo(2, 1 << 20)
    def double(box: list[int]) -> int:
        return 2 * box[0]

    def work(thread: int, i: int) -> None:
        box = [thread * 1_000_000 + i]
        assert double(box) == 2 * box[0]
        assert double(box) == 2 * box[0]

    errors = _hammer(work, seconds=2.0)
    assert not errors, repr(errors[0])
    # the weights still add up: every entry weighs the default
    assert len(double.cache) <= 2
    assert double.cache.held_bytes == len(double.cache) * SMALL_ENTRY_BYTES


def _specs() -> list[tuple[planner.ModelSpec, dict[str, Any]]]:
    dense, moe = planner.load_model("llama-3-8b"), planner.load_model("tiny-moe")
    out: list[tuple[planner.ModelSpec, dict[str, Any]]] = []
    for micro in (1, 2, 4):
        for recompute in ("none", "selective", "full"):
            out.append((dense, {"micro_batch_size": micro, "recompute": recompute}))
            out.append(
                (
                    moe,
                    {
                        "micro_batch_size": micro,
                        "recompute": recompute,
                        "parallel": {"dp": 2, "ep": 2, "zero_stage": 1},
                    },
                )
            )
    out.append((dense, {"parallel": {"tp": 2, "pp": 4, "dp": 2}, "grad_accum_steps": 8}))
    out.append((dense, {"offload": {"mode": "optimizer", "fraction": 0.5}}))
    return out


def test_estimate_fit_and_evaluate_agree_from_many_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hw = planner.gpu("H100-80GB")
    small = planner.gpu("RTX-4090")
    specs = _specs()
    fit_model = planner.load_model("tiny-moe")
    fit_train = planner.TrainSpec(micro_batch_size=4, grad_accum_steps=2)
    # single-threaded answers, with the caches at their real size
    estimator.clear_spec_caches()
    expected = [
        planner.estimate(model, planner.TrainSpec.model_validate(train), hw).model_dump()
        for model, train in specs
    ]
    base = [planner.knobs(planner.TrainSpec.model_validate(t)) for _, t in specs]
    evaluated = [
        planner.evaluate(model, kn._replace(micro_batch=8), hw).gpu_peak_bytes
        for (model, _), kn in zip(specs, base, strict=True)
    ]
    fitted = planner.fit(fit_model, fit_train, small).model_dump()

    # every miss now evicts another thread's entry
    for cache in (estimator._STATES, estimator._ACTS):
        monkeypatch.setattr(cache, "maxsize", 2)
    estimator.clear_spec_caches()

    def work(thread: int, i: int) -> None:
        n = (thread + i) % len(specs)
        model, train = specs[n]
        # a fresh spec object: the identity-keyed caches miss and evict too
        budget = planner.estimate(model, planner.TrainSpec.model_validate(train), hw)
        assert budget.model_dump() == expected[n], (n, train)
        peak = planner.evaluate(model, base[n]._replace(micro_batch=8), hw).gpu_peak_bytes
        assert peak == evaluated[n], (n, train)
        if i % 50 == thread:
            assert planner.fit(fit_model, fit_train, small).model_dump() == fitted

    errors = _hammer(work)
    assert not errors, repr(errors[0])
    # still bounded, and the weights held are those of the entries there
    for cache in (estimator._STATES, estimator._ACTS):
        assert len(cache) <= 2
        assert 0 < cache.held_bytes == sum(cache._weights[key] for key in cache)
