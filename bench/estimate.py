"""Estimates per second in process (target: <= 20 µs per estimate).

Specs are parsed once, as a service or the ladder would; each timed call runs the full
estimate (both pipeline end stages when pp > 1, every phase, the Budget object).
Run: .venv/bin/python bench/estimate.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import platform
import time

import planner

CASES = {
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
}


def bench(seconds: float) -> None:
    hw = planner.gpu("H200-141GB")
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{platform.processor() or 'cpu'}"
    )
    print(f"{'case':40s} {'µs/estimate':>12s} {'estimates/s':>12s}")
    for name, (model_name, train) in CASES.items():
        model = planner.load_model(model_name)
        spec = planner.TrainSpec(**train)
        planner.estimate(model, spec, hw)  # warm the caches a service keeps warm
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            n = 2000
            start = time.perf_counter()
            for _ in range(n):
                planner.estimate(model, spec, hw)
            best = min(best, (time.perf_counter() - start) / n)
        print(f"{name:40s} {best * 1e6:12.2f} {1 / best:12,.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per case")
    bench(parser.parse_args().seconds)
