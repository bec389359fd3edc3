"""The auto-fit ladder's search time (target: >= 5,000 candidates in <= 50 ms).

Each case is one ``planner.fit`` call on a parsed spec, as ``headroom fit`` and ``POST /fit``
make it: every candidate of the grid is estimated, the fitting ones are priced by the step-time
model and ranked, and the chosen plan is validated, estimated and dumped. Two timings per case:

- cold: the spec-dependent caches are cleared before every search (a new question);
- warm: the same search again (the service asked twice).

Run: .venv/bin/python bench/ladder.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

from headroom import planner
from headroom.planner.estimator import clear_spec_caches

CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-3-70b tp8 dp8, batch 128/rank": (
        "llama-3-70b",
        "H100-80GB",
        {"micro_batch_size": 8, "grad_accum_steps": 16, "parallel": {"tp": 8, "dp": 8}},
    ),
    "llama-3-8b dp8, batch 512/rank": (
        "llama-3-8b",
        "H100-80GB",
        {"micro_batch_size": 4, "grad_accum_steps": 128, "parallel": {"dp": 8}},
    ),
    "mixtral-8x7b dp8 ep8, batch 512/rank": (
        "mixtral-8x7b",
        "H200-141GB",
        {"micro_batch_size": 2, "grad_accum_steps": 256, "parallel": {"dp": 8, "ep": 8}},
    ),
    "deepseek-v3 pp16 dp8 ep8, batch 256/rank": (
        "deepseek-v3",
        "H200-141GB",
        {
            "micro_batch_size": 1,
            "grad_accum_steps": 256,
            "parallel": {"pp": 16, "dp": 8, "ep": 8},
        },
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {args.repeats} repeats")
    print(f"{'case':44} {'cand.':>6} {'fit':>5} {'cold ms':>16} {'warm ms':>16}")
    for name, (model_name, gpu, train_data) in CASES.items():
        model = planner.load_model(model_name)
        train = planner.load_train(train_data)
        hw = planner.gpu(gpu)
        cold, warm = [], []
        result = planner.fit(model, train, hw)
        for _ in range(args.repeats):
            clear_spec_caches()
            train = planner.load_train(train_data)
            start = time.perf_counter()
            result = planner.fit(model, train, hw)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            planner.fit(model, train, hw)
            warm.append(time.perf_counter() - start)
        print(
            f"{name:44} {result.candidates_considered:>6} {result.candidates_fitting:>5} "
            f"{statistics.median(cold) * 1e3:>7.1f} (min {min(cold) * 1e3:4.1f}) "
            f"{statistics.median(warm) * 1e3:>7.1f} (min {min(warm) * 1e3:4.1f})"
        )


if __name__ == "__main__":
    main()
