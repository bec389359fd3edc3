"""Headroom against GPU training runs that other people published
(``calibration/data/published-memory.json``): the judge of every estimate.

Each run in the file carries its source (URL, commit, the quote holding the number), the
configuration as published, which figure was measured and the outcome, and the Headroom spec
it maps to. Replaying a run estimates that spec and compares like with like:

- ``max_allocated`` and ``peak_active`` (PyTorch's ``allocated_bytes.all.peak`` and
  ``active_bytes.all.peak``) against the peak less ``cuda_context`` and
  ``allocator_overhead``;
- ``max_reserved`` (``reserved_bytes.all.peak``) against the peak less ``cuda_context``;
- ``nvidia_smi_total`` (what ``nvidia-smi`` shows) against the whole peak;
- ``oom`` (the run ran out of memory) and ``none`` (it fit; no usable number) against the
  verdict alone.

A figure is one rank's: under pipeline parallelism a run that names the rank that logged it
(``measured_stage``, ``first`` or ``last``) is compared with that stage's estimate, else with
the heaviest stage's (the estimate's peak).

A spec the estimate refuses (a model or an option it does not price yet) counts as a wrong
verdict, with the reason.

A verdict is right when the estimate fits (with the default margin) and the run fit, or does
not fit and the run ran out of memory. A false fit (predicted to fit, ran out of memory) is the
worst miss an OOM predictor makes.

``python -m headroom.calibration.published`` prints every run and a summary per stack;
``--json`` prints the same as JSON. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal, get_args

from headroom import planner
from headroom.calibration.comparison import named_stage
from headroom.planner.estimator import StagePeak

Figure = Literal["max_allocated", "max_reserved", "peak_active", "nvidia_smi_total", "oom", "none"]
FIGURES: tuple[str, ...] = get_args(Figure)
GIB = 2**30


def published_file() -> bytes:
    """The shipped file's bytes."""
    return (resources.files("headroom.calibration") / "data" / "published-memory.json").read_bytes()


@cache
def load() -> dict[str, Any]:
    """The shipped file, parsed once."""
    data: dict[str, Any] = json.loads(published_file())
    return data


def runs() -> list[dict[str, Any]]:
    """Every run of the file, in its order."""
    found: list[dict[str, Any]] = load()["runs"]
    return found


def spec_of(run: dict[str, Any]) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware]:
    """The model, training spec and GPU a run maps to."""
    spec = run["spec"]
    model = planner.load_model(spec["model"])
    train = planner.load_train(spec["train"])
    gpu = spec["gpu"]
    if isinstance(gpu, dict) and "preset" in gpu:
        base = planner.gpu(gpu["preset"])
        hardware = base.model_copy(update={k: v for k, v in gpu.items() if k != "preset"})
    else:
        hardware = planner.load_hardware(gpu)
    return model, train, hardware


def comparable_bytes(budget: planner.Budget, figure: str) -> int | None:
    """The part of the estimate's peak that ``figure`` measures (None for an OOM)."""
    gpu = budget.gpu
    return _figure(figure, gpu.allocated_peak_bytes, gpu.reserved_peak_bytes, gpu.peak_bytes)


def stage_bytes(peak: StagePeak, figure: str) -> int | None:
    """The part of one stage's peak that ``figure`` measures (None for an OOM)."""
    return _figure(figure, peak.allocated_bytes, peak.reserved_bytes, peak.peak_bytes)


def _figure(figure: str, allocated: int, reserved: int, whole: int) -> int | None:
    """Which of a peak's three figures ``figure`` is: allocated (and active) bytes, reserved
    bytes, or the whole GPU as ``nvidia-smi`` shows it; None for an OOM or no number."""
    if figure in ("max_allocated", "peak_active"):
        return allocated
    if figure == "max_reserved":
        return reserved
    if figure == "nvidia_smi_total":
        return whole
    return None


def measured_bytes(
    run: dict[str, Any],
    budget: planner.Budget,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    hardware: planner.Hardware,
) -> int | None:
    """The estimate of what ``run`` measured: on the stage whose rank logged it
    (``measured_stage``: ``first`` or ``last``; Megatron-LM logs the last rank's statistics),
    else on the heaviest stage (a run that gives the largest over its ranks, or does not
    say)."""
    peak = named_stage(run.get("measured_stage"), model, train, hardware)
    if peak is None:
        return comparable_bytes(budget, run["figure"])
    return stage_bytes(peak, run["figure"])


@dataclass(frozen=True)
class Replay:
    """One published run against its estimate."""

    id: str
    stack: str
    split: str
    figure: str
    outcome: str
    measured_gib: float | None
    predicted_gib: float | None
    error_pct: float | None
    peak_gib: float | None
    capacity_gib: float | None
    peak_phase: str | None
    fits: bool | None
    right: bool
    false_fit: bool
    false_oom: bool
    not_modelled: tuple[str, ...]
    refused: str | None = None
    measured_stage: str = "heaviest"  # the stage whose estimate is compared


def replay(run: dict[str, Any], margin_pct: float | None = None) -> Replay:
    """Estimate ``run``'s spec and compare it with what the run measured and how it ended."""
    common = {
        "id": run["id"],
        "stack": run["stack"],
        "split": run.get("split", "fit"),
        "figure": run["figure"],
        "outcome": run["outcome"],
        "measured_gib": run.get("measured_gib"),
        "not_modelled": tuple(run.get("not_modelled", ())),
        "measured_stage": run.get("measured_stage", "heaviest"),
    }
    try:
        model, train, hardware = spec_of(run)
        budget = planner.estimate(model, train, hardware)
    except (planner.HeadroomError, ValueError) as exc:
        reason = str(exc).splitlines()[0]
        return Replay(
            **common,
            predicted_gib=None,
            error_pct=None,
            peak_gib=None,
            capacity_gib=None,
            peak_phase=None,
            fits=None,
            right=False,
            false_fit=False,
            false_oom=False,
            refused=reason,
        )
    fits = bool(planner.gate(budget, margin_pct=margin_pct).fits)
    measured = common["measured_gib"]
    predicted = measured_bytes(run, budget, model, train, hardware)
    predicted_gib = None if predicted is None else predicted / GIB
    error = None
    if measured and predicted_gib is not None:
        error = 100.0 * (predicted_gib - measured) / measured
    ran = run["outcome"] == "fit"
    return Replay(
        **common,
        predicted_gib=predicted_gib,
        error_pct=error,
        peak_gib=budget.gpu_peak_bytes / GIB,
        capacity_gib=budget.gpu.capacity_bytes / GIB,
        peak_phase=budget.peak_phase,
        fits=fits,
        right=fits == ran,
        false_fit=fits and not ran,
        false_oom=ran and not fits,
    )


def replay_all(
    selected: Iterable[dict[str, Any]] | None = None, margin_pct: float | None = None
) -> list[Replay]:
    """Every run (or ``selected``) replayed."""
    return [replay(run, margin_pct) for run in (runs() if selected is None else selected)]


@dataclass(frozen=True)
class Summary:
    """How a group of runs came out."""

    group: str
    runs: int
    right: int
    false_fits: int
    false_ooms: int
    refused: int
    measured: int
    median_abs_error_pct: float | None
    worst_under_pct: float | None
    worst_over_pct: float | None

    @property
    def right_pct(self) -> float:
        return 100.0 * self.right / self.runs if self.runs else 0.0


def summarize(group: str, rows: Sequence[Replay]) -> Summary:
    errors = [r.error_pct for r in rows if r.error_pct is not None]
    return Summary(
        group=group,
        runs=len(rows),
        right=sum(r.right for r in rows),
        false_fits=sum(r.false_fit for r in rows),
        false_ooms=sum(r.false_oom for r in rows),
        refused=sum(r.refused is not None for r in rows),
        measured=len(errors),
        median_abs_error_pct=statistics.median(abs(e) for e in errors) if errors else None,
        worst_under_pct=min(errors) if errors and min(errors) < 0 else None,
        worst_over_pct=max(errors) if errors and max(errors) > 0 else None,
    )


def summaries(rows: Sequence[Replay]) -> list[Summary]:
    """One summary per stack, then per split, then all runs."""
    out = [summarize(s, [r for r in rows if r.stack == s]) for s in sorted({r.stack for r in rows})]
    out += [summarize(f"split {s}", [r for r in rows if r.split == s]) for s in ("fit", "held_out")]
    out.append(summarize("all", rows))
    return out


@dataclass(frozen=True)
class MarginRow:
    """The verdicts of a split at one margin."""

    margin_pct: int
    split: str
    right: int
    false_fits: int
    false_ooms: int


def margin_sweep(
    margins: Iterable[int] = range(21), selected: Iterable[dict[str, Any]] | None = None
) -> list[MarginRow]:
    """The verdicts of each split at each margin (whole percent of the peak)."""
    chosen = list(runs() if selected is None else selected)
    out = []
    for margin in margins:
        rows = replay_all(chosen, float(margin))
        for split in ("fit", "held_out"):
            part = [r for r in rows if r.split == split]
            out.append(
                MarginRow(
                    margin,
                    split,
                    sum(r.right for r in part),
                    sum(r.false_fit for r in part),
                    sum(r.false_oom for r in part),
                )
            )
    return out


def default_margin_pct(sweep: Sequence[MarginRow]) -> int:
    """The margin the published runs support: the largest (on the sweep's grid) at which the
    fitted split loses no verdict it has at margin 0 (a margin guards against an
    under-prediction turning an OOM into a fit, at the price of runs near the capacity)."""
    fitted = [row for row in sweep if row.split == "fit"]
    best = max(row.right for row in fitted if row.margin_pct == 0)
    margin = 0
    for row in sorted(fitted, key=lambda r: r.margin_pct):
        if row.right < best:
            break
        margin = row.margin_pct
    return margin


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1f} %"


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def render(rows: Sequence[Replay]) -> str:
    """The table of runs and the summaries, as text."""
    lines = [
        f"{'run':48} {'stack':18} {'split':8} {'figure':16} {'stage':8} {'measured':>9} "
        f"{'predicted':>9} {'error':>9}  {'verdict':7} {'outcome':7} {'':5}",
    ]
    for r in rows:
        if r.refused is not None:
            lines.append(f"{r.id:48} {r.stack:18} {r.split:8} refused: {r.refused}")
            continue
        mark = "ok" if r.right else ("FALSE FIT" if r.false_fit else "false oom")
        lines.append(
            f"{r.id:48} {r.stack:18} {r.split:8} {r.figure:16} {r.measured_stage:8} "
            f"{_gib(r.measured_gib):>9} {_gib(r.predicted_gib):>9} {_pct(r.error_pct):>9}  "
            f"{'fits' if r.fits else 'oom':7} {r.outcome:7} {mark}"
        )
    lines.append("")
    lines.append(
        f"{'group':20} {'runs':>4} {'right':>6} {'right %':>8} {'false fits':>10} "
        f"{'false ooms':>10} {'refused':>7} {'measured':>8} {'median |err|':>12} "
        f"{'worst under':>11} {'worst over':>10}"
    )
    for s in summaries(rows):
        median = "" if s.median_abs_error_pct is None else f"{s.median_abs_error_pct:.1f} %"
        lines.append(
            f"{s.group:20} {s.runs:>4} {s.right:>6} {s.right_pct:>7.1f}% {s.false_fits:>10} "
            f"{s.false_ooms:>10} {s.refused:>7} {s.measured:>8} {median:>12} "
            f"{_pct(s.worst_under_pct):>11} {_pct(s.worst_over_pct):>10}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headroom.calibration.published",
        description="Headroom's verdict and peak against published GPU runs.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--stack", help="only this stack's runs")
    parser.add_argument("--split", choices=("fit", "held_out"), help="only this split")
    parser.add_argument(
        "--margin", type=float, default=None, help="margin %% (default: the estimate's own)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the verdicts of each split at margins 0-20 %% and the margin they support",
    )
    args = parser.parse_args(argv)
    selected = [
        run
        for run in runs()
        if (args.stack is None or run["stack"] == args.stack)
        and (args.split is None or run.get("split") == args.split)
    ]
    if not selected:
        print(f"no run matches --stack {args.stack} --split {args.split}", file=sys.stderr)
        return 2
    if args.sweep:
        sweep = margin_sweep(selected=selected)
        print(f"{'margin':>6} {'split':8} {'right':>5} {'false fits':>10} {'false ooms':>10}")
        for m in sweep:
            print(
                f"{m.margin_pct:>5}% {m.split:8} {m.right:>5} {m.false_fits:>10} {m.false_ooms:>10}"
            )
        print(f"supported default margin: {default_margin_pct(sweep)} %")
        return 0
    rows = replay_all(selected, args.margin)
    if args.json:
        out = {
            "runs": [asdict(r) for r in rows],
            "summaries": [{**asdict(s), "right_pct": s.right_pct} for s in summaries(rows)],
        }
        print(json.dumps(out, indent=2))
    else:
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
