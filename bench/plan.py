"""The cluster plan's search time (target: >= 100,000 candidate layouts in <= 1 s).

Each case is one ``planner.plan`` call, as ``headroom plan`` and ``POST /plan`` make it: every
layout of at most N GPUs and every per-rank choice inside it is priced, the candidates are
walked fastest first through the estimate until the chosen one and ten runners-up fit, and the
chosen layout is validated, estimated and dumped. Cold: the spec-dependent caches are cleared
before every search. The throughput column is candidates considered per second of the search.
The last two columns price every candidate of every layout (no floor skips them) and sort
them, without the walk: the search's raw pricing rate.

Run: .venv/bin/python bench/plan.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from headroom import planner
from headroom.planner.cluster import cluster_preset
from headroom.planner.estimator import clear_spec_caches
from headroom.planner.layout import Planner

#: (model, cluster, GPUs, global batch, sequence)
CASES: dict[str, tuple[str, str, int, int, int]] = {
    "llama-3-8b, 8 H100, batch 256 x 8k": ("llama-3-8b", "DGX-H100", 8, 256, 8192),
    "llama-3-70b, 32 H100, batch 512 x 8k": ("llama-3-70b", "DGX-H100", 32, 512, 8192),
    "llama-3-70b, 64 H100, batch 1024 x 8k": ("llama-3-70b", "DGX-H100", 64, 1024, 8192),
    "mixtral-8x7b, 64 H200, batch 512 x 4k": ("mixtral-8x7b", "DGX-H200", 64, 512, 4096),
    "gpt3-175b, 1024 A100, batch 1536 x 2k": ("gpt3-175b", "DGX-A100", 1024, 1536, 2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="Run the cases whose name contains this.")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {args.repeats} repeats")
    print(
        f"{'case':40} {'layouts':>7} {'cand.':>9} {'estim.':>6} {'cold s':>16} {'cand/s':>10}"
        f" {'all priced':>10} {'s':>6}"
    )
    for name, (model_name, cluster_name, gpus, batch, seq) in CASES.items():
        if args.only and args.only not in name:
            continue
        model = planner.load_model(model_name)
        cl = cluster_preset(cluster_name)
        hw = cl.hardware()
        times = []
        result = None
        for _ in range(args.repeats):
            clear_spec_caches()
            start = time.perf_counter()
            result = planner.plan(model, planner.TrainSpec(), cl, hw, gpus, batch, seq)
            result.model_dump_json()
            times.append(time.perf_counter() - start)
        assert result is not None
        best = min(times)
        clear_spec_caches()
        start = time.perf_counter()
        everything = Planner(model, planner.TrainSpec(), cl, hw, gpus, batch, seq)
        priced = everything.candidates(everything.layouts(), [], {"model_states": 0})
        priced.sort()
        all_seconds = time.perf_counter() - start
        print(
            f"{name:40} {result.layouts_considered:>7} {result.candidates_considered:>9,} "
            f"{result.candidates_estimated:>6} {statistics.median(times):>7.3f} "
            f"(min {best:5.3f}) {result.candidates_considered / best:>10,.0f} "
            f"{len(priced):>10,} {all_seconds:>6.3f}"
        )


if __name__ == "__main__":
    main()
