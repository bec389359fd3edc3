"""The step-time model against published throughput of real runs.

``calibration/data/published-throughput.json`` holds runs with their layout, batch and the
per-GPU FLOP/s their authors measured (each with its source). ``replay`` prices each run's own
layout with the plan's step-time model (``planner.layout``) on the cluster it ran on and
compares the predicted time per iteration with the published one (the authors' FLOPs over GPUs
x achieved FLOP/s). Where a run's micro-batch is not published, the fastest that fits is taken,
as the plan would. ``fit_efficiency`` fits the coefficients' ``compute_efficiency`` (the
achieved fraction of peak FLOP/s of large matrix multiplies) to some cases, so the others can
be held out.

Run: python -m headroom.calibration.throughput [--efficiency E]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from functools import cache
from importlib import resources
from typing import Any, NamedTuple

from headroom import planner
from headroom.planner.cluster import cluster_preset
from headroom.planner.estimator import end_stages, gpu_peak
from headroom.planner.layout import RECOMPUTE, Layout, Planner


class Replay(NamedTuple):
    """One published run against the model."""

    id: str
    published_seconds: float
    predicted_seconds: float
    micro_batch: int
    fits: bool  # the estimate's verdict on the run's heaviest rank

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_seconds - self.published_seconds) / self.published_seconds


@cache
def published() -> dict[str, Any]:
    """The committed cases."""
    path = resources.files("headroom.calibration") / "data" / "published-throughput.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@cache
def cases_by_id() -> dict[str, dict[str, Any]]:
    """The committed cases by their ids."""
    return {c["id"]: c for c in published()["cases"]}


def _model(case: dict[str, Any], doc: dict[str, Any]) -> planner.ModelSpec:
    if "preset" in case:
        return planner.load_model(case["preset"])
    if "model_spec" in case:  # a model no preset holds, as a model file would give it
        return planner.load_model(case["model_spec"])
    m = case["model"]
    h = m["hidden_size"]
    return planner.ModelSpec(
        name=case["id"],
        vocab_size=doc["vocab_size"],
        hidden_size=h,
        num_layers=m["num_layers"],
        num_heads=m["num_heads"],
        ffn_hidden_size=4 * h,
        ffn_kind="gelu",
        norm="layernorm",
        tied_embeddings=True,
        linear_bias=True,
        dropout=True,
    )


def published_seconds(case: dict[str, Any], doc: dict[str, Any]) -> float:
    """The run's time per iteration: its tokens over GPUs x the tokens per second per GPU
    published, or Narayanan et al.'s eq. 3 FLOPs (recompute included) over GPUs x the achieved
    FLOP/s per GPU."""
    if "published_tokens_per_second_per_gpu" in case:
        tokens = case["global_batch"] * case["seq_len"]
        return float(tokens / (case["gpus"] * case["published_tokens_per_second_per_gpu"]))
    m = case["model"]
    h, layers = m["hidden_size"], m["num_layers"]
    s, v, batch = doc["seq_len"], doc["vocab_size"], case["global_batch"]
    flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return float(flops / (case["gpus"] * case["published_tflops_per_gpu"] * 1e12))


def train_spec(case: dict[str, Any]) -> planner.TrainSpec:
    """The training spec a case ran (its micro-batch and accumulation are the replay's)."""
    tp, pp, cp = case["tp"], case["pp"], case.get("cp", 1)
    return planner.TrainSpec(
        seq_len=case.get("seq_len", published()["seq_len"]),
        recompute=case.get("recompute", "full"),
        attention=case.get("attention", "eager"),
        framework=case.get("framework", "none"),
        parallel={
            "dp": case["gpus"] // (tp * pp * cp),
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "zero_stage": case["zero_stage"],
            **(
                {"sequence_parallel": case["sequence_parallel"]}
                if "sequence_parallel" in case
                else {}
            ),
        },
        max_grad_norm=1.0,
        **({"precision": case["precision"]} if "precision" in case else {}),
    )


def replay(
    case: dict[str, Any],
    coefficients: planner.Coefficients | None = None,
    efficiency: float | None = None,
) -> Replay:
    """Price one published run's own layout (see the module docstring); ``efficiency`` stands
    for its GPU's ``compute_efficiency`` (a fit tries values)."""
    doc = published()
    model = _model(case, doc)
    cl = cluster_preset(case.get("cluster", doc["cluster"]))
    # a GPU that differs from its preset (a power cap, another memory) says how
    hw = cl.hardware().model_copy(update=case.get("gpu", {}))
    if efficiency is not None:
        hw = hw.model_copy(update={"compute_efficiency": efficiency})
    tp, pp, gpus = case["tp"], case["pp"], case["gpus"]
    cp, vpp = case.get("cp", 1), case.get("vpp", 1)
    dp = gpus // (tp * pp * cp)
    seq = case.get("seq_len", doc["seq_len"])
    recompute = case.get("recompute", "full")
    train = train_spec(case)
    coeffs = coefficients or planner.default_coefficients("textbook", hw.name)
    plan = Planner(model, train, cl, hw, gpus, case["global_batch"], seq, coeffs)
    lay = Layout(gpus, tp, pp, vpp, cp, dp, 1)
    costs = plan.costs(lay)
    per_rank = case["global_batch"] // dp
    given = case["micro_batch_size"]
    micro = [given] if given else [b for b in (1, 2, 4, 8, 16) if per_rank % b == 0]
    r = [policy for policy, _, _ in RECOMPUTE].index(recompute)
    best: Replay | None = None
    for mb in micro:
        settings = plan.settings(lay, case["zero_stage"], ("none", 1.0, None), mb, r, False)
        allocated, _ = end_stages(model, settings, coeffs)
        peak = gpu_peak(allocated, plan.over[False]).gpu_bytes
        fits = peak + math.ceil(peak * coeffs.margin_fraction) <= hw.memory_bytes
        t = plan.step_terms(lay, costs, case["zero_stage"], "none", 0, mb, r)
        run = Replay(case["id"], published_seconds(case, doc), t.step, mb, fits)
        # the fastest that fits; if none fits, the fastest (the verdict is reported)
        if best is None or (run.fits, -run.predicted_seconds) > (
            best.fits,
            -best.predicted_seconds,
        ):
            best = run
    assert best is not None
    return best


def replay_all(
    coefficients: planner.Coefficients | None = None, ids: list[str] | None = None
) -> list[Replay]:
    cases = published()["cases"]
    return [replay(c, coefficients) for c in cases if ids is None or c["id"] in ids]


def fit_efficiency(ids: list[str]) -> float:
    """The ``compute_efficiency`` whose median error over ``ids`` is zero (bisection: the
    predicted time falls as the efficiency rises)."""
    base = planner.default_coefficients("textbook", "A100-80GB")
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        coeffs = base.model_copy(update={"compute_efficiency": mid})
        errors = [r.error for r in replay_all(coeffs, ids)]
        if statistics.median(errors) > 0:  # predicted slower: more efficiency
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def gpu_name(case: dict[str, Any]) -> str:
    """The GPU a case ran on: its cluster's."""
    return cluster_preset(case.get("cluster", published()["cluster"])).hardware().name


def summary(rows: list[Replay]) -> list[tuple[str, str, str, int, float, float]]:
    """(stack, GPU, split, cases, median |error|, worst |error|) over every case the model
    prices as it ran (compiled cases left out: torch.compile is not a knob of the model)."""
    cases = cases_by_id()
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        c = cases[r.id]
        if c.get("compile"):
            continue
        groups.setdefault((c["stack"], gpu_name(c), c["split"]), []).append(r.error)
    return [
        (*key, len(e), statistics.median(abs(x) for x in e), max(abs(x) for x in e))
        for key, e in sorted(groups.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=None)
    args = parser.parse_args()
    coeffs = None
    if args.efficiency is not None:
        coeffs = planner.default_coefficients("textbook", "A100-80GB").model_copy(
            update={"compute_efficiency": args.efficiency}
        )
    cases = cases_by_id()
    rows = replay_all(coeffs)
    for r in rows:
        c = cases[r.id]
        notes = ("" if r.fits else "  (estimate: does not fit)") + (
            "  (compiled: not modelled)" if c.get("compile") else ""
        )
        print(
            f"{r.id:42s} {c['stack']:10s} {gpu_name(c):10s} {c['split']:8s} mb {r.micro_batch:2d} "
            f"published {r.published_seconds:8.2f} s predicted {r.predicted_seconds:8.2f} s "
            f"error {100 * r.error:+6.1f} %{notes}"
        )
    print()
    print(
        f"{'stack':10s} {'GPU':10s} {'split':8s} {'cases':>5s} {'median |err|':>12s} {'worst':>7s}"
    )
    for stack, gpu, split, n, med, worst in summary(rows):
        print(f"{stack:10s} {gpu:10s} {split:8s} {n:5d} {100 * med:11.1f}% {100 * worst:6.1f}%")


if __name__ == "__main__":
    main()
