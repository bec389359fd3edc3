"""Estimates per second in process (target: <= 20 µs per estimate).

Specs are parsed once, as a service or the ladder would. Three measurements per case:

- repeat: ``planner.estimate`` on one spec, over and over (a service answering the same
  question). ``estimate`` memoises a spec's end stages (their largest phases and host bytes)
  per knobs object, so a repeat costs the verdict (coefficients, overheads, peak, margin,
  warnings) and the ``Budget``, not the phases.
- sweep: ``planner.evaluate`` on distinct candidates made with ``knobs(train)._replace`` (micro-
  batch x sequence length x recompute x offload fraction), each evaluated exactly once after the
  spec-dependent caches are cleared; model-derived facts stay warm. ``evaluate`` memoises no
  candidate's end stages, so each computes its activation terms (unless an earlier candidate
  had the same ``ActivationInputs``) and every phase of both pipeline end stages when pp > 1;
  its persistent state is the earlier candidates' (same ``StatesInputs``). This is the
  ladder's load.
- dump: ``Budget.model_dump()`` on top of an estimate (what the API and ``--format json`` add).

Run: .venv/bin/python bench/estimate.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
from typing import Any

from headroom import planner
from headroom.planner.estimator import clear_spec_caches

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b default": ("llama-3-8b", {}),
    "llama-3-70b tp8 pp4 zero1": (
        "llama-3-70b",
        {"parallel": {"dp": 8, "tp": 8, "pp": 4, "zero_stage": 1}},
    ),
    "mixtral ep8 optimizer-offload 0.5": (
        "mixtral-8x7b",
        {
            "parallel": {"dp": 8, "ep": 8, "zero_stage": 1},
            "recompute": "full",
            "offload": {"mode": "optimizer", "fraction": 0.5},
        },
    ),
    "deepseek-v3 pp16 dp64 ep64": (
        "deepseek-v3",
        {"parallel": {"dp": 64, "pp": 16, "ep": 64, "zero_stage": 1}},
    ),
    "llama-3-8b streaming k=4": (
        "llama-3-8b",
        {"offload": {"mode": "streaming", "checkpoint_every": 4}},
    ),
    "llama-3-70b fsdp2 dp64 tp8 hf": (
        "llama-3-70b",
        {
            "framework": "fsdp2",
            "activation_profile": "hf",
            "precision": {"grads": "fp32"},
            "parallel": {"dp": 64, "tp": 8, "zero_stage": 3, "sequence_parallel": True},
        },
    ),
    "llama-3-70b fsdp2 dp64 torchtitan": (
        "llama-3-70b",
        {
            "framework": "fsdp2",
            "fsdp2": {"groups": "split"},
            "activation_profile": "torchtitan",
            "recompute": "full",
            "precision": {"grads": "fp32"},
            "parallel": {"dp": 64, "zero_stage": 3},
        },
    ),
    "llama-3-70b deepspeed zero3 dp64": (
        "llama-3-70b",
        {"framework": "deepspeed", "parallel": {"dp": 64, "zero_stage": 3}},
    ),
    "mixtral fsdp2 dp32 ep8 no-reshard": (
        "mixtral-8x7b",
        {
            "framework": "fsdp2",
            "fsdp2": {"reshard_after_forward": False},
            "parallel": {"dp": 32, "ep": 8, "zero_stage": 3},
        },
    ),
}

# recompute as knobs: (selective, checkpoint_every)
RECOMPUTE = [(False, None), (True, None), (False, 1), (False, 2), (False, 4)]


def _best_per_call(fn: Any, seconds: float, n: int = 2000) -> float:
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best


def _candidates(kn: planner.Knobs) -> list[planner.Knobs]:
    fractions = (
        [0.0, 0.25, 0.5, 0.75, 1.0] if kn.offload_mode == "optimizer" else [kn.offload_fraction]
    )
    out = []
    for mb, seq, (selective, k), f in itertools.product(
        range(1, 9), (2048, 4096, 8192), RECOMPUTE, fractions
    ):
        if kn.offload_mode == "streaming" and k is None:
            k = kn.checkpoint_every
        out.append(
            kn._replace(
                micro_batch=mb,
                seq_len=seq,
                selective=selective,
                checkpoint_every=k,
                offload_fraction=f,
            )
        )
    return out


def _sweep(
    model: planner.ModelSpec, kn: planner.Knobs, hw: planner.Hardware, seconds: float
) -> tuple[int, float]:
    candidates = _candidates(kn)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        clear_spec_caches()
        start = time.perf_counter()
        for c in candidates:
            planner.evaluate(model, c, hw)
        best = min(best, (time.perf_counter() - start) / len(candidates))
    return len(candidates), best


def bench(seconds: float) -> None:
    hw = planner.gpu("H200-141GB")
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{platform.processor() or 'cpu'}"
    )
    header = f"{'case':36s} {'repeat µs':>10s} {'sweep µs':>9s} {'(n)':>5s} {'dump µs':>8s}"
    print(header)
    for name, (model_name, train) in CASES.items():
        model = planner.load_model(model_name)
        spec = planner.TrainSpec(**train)
        planner.estimate(model, spec, hw)  # warm the model-derived caches a service keeps warm
        repeat = _best_per_call(lambda: planner.estimate(model, spec, hw), seconds)  # noqa: B023
        n, sweep = _sweep(model, planner.knobs(spec), hw, seconds)
        with_dump = _best_per_call(
            lambda: planner.estimate(model, spec, hw).model_dump(),  # noqa: B023
            seconds / 2,
            n=200,
        )
        print(
            f"{name:36s} {repeat * 1e6:10.2f} {sweep * 1e6:9.2f} {n:5d} "
            f"{(with_dump - repeat) * 1e6:8.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per case")
    bench(parser.parse_args().seconds)
