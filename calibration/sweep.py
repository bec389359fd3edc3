"""The step-time model against a published sweep of layouts: does it rank them as they ran?

``calibration/data/nanotron-sweep.json`` holds every run of the Ultra-Scale Playbook's cluster
benchmark (nanotron on 1-64 nodes of 8 H100s; Llama-shaped models of 1B, 3B, 8B, 80B and 469B
parameters; sequence 4,096; 256 sequences a step; every DP x TP x PP x micro-batch x ZeRO 0/1
it could run), each as the verbatim hover text of the playbook's figure. ``runs`` parses them;
``replay`` prices each finished run's own layout with the plan's step-time model
(``calibration/throughput.py``: a DGX H100 cluster, nanotron's stack as its base config sets it:
bf16 with fp32 gradient accumulation, 1F1B, sequence parallelism under TP, no recomputation,
flash attention); ``groups`` compares, for every (model, GPUs) group of at least five distinct
layouts:

- ``spearman``: the rank correlation of predicted with measured tokens/s per GPU;
- ``median_error``: the median of (predicted - measured) / measured step time;
- ``pick_ratio``: the measured throughput of the layout the model ranks first, over the group's
  best measured (1.0: the model picks the fastest).

The file names its held-out runs (every run on 16, 32 and 128 GPUs), chosen before any fit;
``fit_runs`` are the rest.

``memory_rows`` holds each finished run's reserved peak (the figure's "Mem Res", world rank 0's:
the first pipeline stage's) against the first stage's estimate, by how the run splits the model.

Run: python -m headroom.calibration.sweep [--memory] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

from headroom import planner
from headroom.calibration import throughput
from headroom.planner.cluster import cluster_preset
from headroom.planner.estimator import stage_peaks

#: one hover text of the figure (``nan`` where the run crashed or ran out of memory)
_QUOTE = re.compile(
    r"Nodes: (?P<nodes>\d+)<br>MBS: (?P<mbs>\d+)<br>GradAcc: (?P<ga>\d+)<br>GBS: (?P<gbs>\d+)"
    r"<br>DP: (?P<dp>\d+)<br>PP: (?P<pp>\d+)<br>TP: (?P<tp>\d+)<br>ZeRO: (?P<zero>\d+)<br><br>"
    r"<b>Performance:</b><br>MFU:\s+(?P<mfu>\S+)<br>tok/s/gpu:\s+(?P<tps>\S+)<br>tok/s: \S+"
    r"<br>Mem Res \(GB\): (?P<mem>\S+)$"
)
#: the fewest distinct layouts a group is ranked over
MIN_LAYOUTS = 5
#: the cluster preset the runs are priced on
CLUSTER = "DGX-H100"


@cache
def load() -> dict[str, Any]:
    """The committed file, parsed once."""
    path = resources.files("headroom.calibration") / "data" / "nanotron-sweep.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@dataclass(frozen=True)
class SweepRun:
    """One run of the sweep, as its quote gives it (``tokens_per_s_per_gpu`` None: it crashed
    or ran out of memory)."""

    model: str
    nodes: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    grad_accum: int
    zero_stage: int
    global_batch: int
    tokens_per_s_per_gpu: float | None
    reserved_gib: float | None
    quote: str

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def layout(self) -> tuple[int, int, int, int, int]:
        return (self.dp, self.tp, self.pp, self.micro_batch, self.zero_stage)

    @property
    def consistent(self) -> bool:
        """Its GPUs fill its nodes and its batch is the sweep's (26 quotes are not)."""
        doc = load()
        return (
            self.gpus == self.nodes * doc["gpus_per_node"]
            and self.dp * self.micro_batch * self.grad_accum == self.global_batch
        )

    @property
    def held_out(self) -> bool:
        return self.gpus in load()["held_out"]["gpus"]


def _number(text: str) -> float | None:
    return None if text == "nan" else float(text)


def parse(model: str, quote: str) -> SweepRun:
    """A run from its hover text (ValueError if the text is not one)."""
    m = _QUOTE.search(quote)
    if m is None:
        raise ValueError(f"not a run of the sweep: {quote!r}")
    g = m.groupdict()
    return SweepRun(
        model=model,
        nodes=int(g["nodes"]),
        dp=int(g["dp"]),
        tp=int(g["tp"]),
        pp=int(g["pp"]),
        micro_batch=int(g["mbs"]),
        grad_accum=int(g["ga"]),
        zero_stage=int(g["zero"]),
        global_batch=int(g["gbs"]),
        tokens_per_s_per_gpu=_number(g["tps"]),
        reserved_gib=_number(g["mem"]),
        quote=quote,
    )


@cache
def runs() -> tuple[SweepRun, ...]:
    """Every run of the file, in its order."""
    return tuple(parse(r["model"], r["quote"]) for r in load()["runs"])


def priced(run: SweepRun) -> bool:
    """A run the comparison uses: it finished, its quote is consistent, and its model has a
    layer for every pipeline stage."""
    layers = load()["models"][run.model]["layers"]
    return run.tokens_per_s_per_gpu is not None and run.consistent and run.pp <= layers


def case(run: SweepRun) -> dict[str, Any]:
    """The run as a throughput case (``throughput.replay``)."""
    doc = load()
    shape = doc["models"][run.model]
    return {
        "id": f"nanotron-{run.model}-{run.gpus}-{_layout(run.layout).replace(' ', '-')}",
        "model_spec": {
            "name": f"nanotron-{run.model}",
            "vocab_size": shape["vocab"],
            "hidden_size": shape["hidden"],
            "num_layers": shape["layers"],
            "num_heads": shape["heads"],
            "ffn_hidden_size": shape["ffn"],
            "tied_embeddings": shape["tied"],
        },
        "cluster": CLUSTER,
        "tp": run.tp,
        "pp": run.pp,
        "gpus": run.gpus,
        "global_batch": run.global_batch,
        "seq_len": doc["seq_len"],
        "zero_stage": run.zero_stage,
        "micro_batch_size": run.micro_batch,
        "framework": "none",
        "attention": "flash",
        "recompute": "none",
        "sequence_parallel": run.tp > 1,
        # nanotron's accumulate_grad_in_fp32: fp32 gradients, reduced in fp32
        "precision": {
            "params": "bf16",
            "grads": "fp32",
            "master": "fp32",
            "optimizer_states": "fp32",
        },
        "published_tokens_per_second_per_gpu": run.tokens_per_s_per_gpu,
    }


#: the most nodes of a run the step floors are fitted to: at 32 and 64 nodes the same layout
#: repeats with results 1.1-1.5 s a micro-batch apart, which no time per layer describes
FLOOR_FIT_MAX_NODES = 8
#: the TP degrees the pipeline's floor across nodes is fitted over (TP inside a node)
FLOOR_FIT_TP = (2, 4, 8)


def slot_layer_seconds(run: SweepRun) -> float:
    """A run's measured seconds per layer and pass of its first stage in one 1F1B slot: its
    step over ``grad_accum + pp - 1`` slots (the fill and drain included), over twice the
    stage's layers (the earlier stages take the remainder)."""
    layers = -(-int(load()["models"][run.model]["layers"]) // run.pp)
    tokens = run.global_batch * int(load()["seq_len"])
    seconds = tokens / (run.gpus * (run.tokens_per_s_per_gpu or 0.0))
    return seconds / (run.grad_accum + run.pp - 1) / (2 * layers)


@cache
def fit_step_floors() -> dict[str, float]:
    """nanotron's step floors (``Coefficients``' ``tp_host_layer_seconds``,
    ``pp_cross_node_layer_seconds`` and ``..._per_tp``), from the measured times of fit runs
    alone (no model in the loop):

    - under TP, the host's: the median of ``slot_layer_seconds`` over the one-node runs with
      TP > 1 at micro-batch 1 (the least GPU work a layer-pass has; the GPU's hides it above);
    - a pipeline across nodes: per TP degree of ``FLOOR_FIT_TP``, the median over the runs of
      at most ``FLOOR_FIT_MAX_NODES`` nodes with PP > 1 across nodes at micro-batch 1-2, then
      the least-squares line ``a + b x tp`` through the medians.
    """
    per_node = load()["gpus_per_node"]
    fit = [r for r in runs() if priced(r) and not r.held_out]
    host = statistics.median(
        slot_layer_seconds(r) for r in fit if r.gpus <= per_node and r.tp > 1 and r.micro_batch == 1
    )
    points = []
    for tp in FLOOR_FIT_TP:
        times = [
            slot_layer_seconds(r)
            for r in fit
            if per_node < r.gpus <= FLOOR_FIT_MAX_NODES * per_node
            and r.pp > 1
            and r.tp == tp
            and r.micro_batch <= 2
        ]
        points.append((float(tp), statistics.median(times)))
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return {
        "tp_host_layer_seconds": host,
        "pp_cross_node_layer_seconds": my - slope * mx,
        "pp_cross_node_layer_seconds_per_tp": slope,
    }


@cache
def coefficients(floors: bool = True) -> planner.Coefficients:
    """The coefficients a run is priced with: the H100's textbook set, with nanotron's step
    floors (``fit_step_floors``) unless ``floors`` is false."""
    hw = cluster_preset(CLUSTER).hardware()
    base = planner.default_coefficients("textbook", hw.name)
    return base.model_copy(update=fit_step_floors()) if floors else base


def replay(
    run: SweepRun, efficiency: float | None = None, floors: bool = True
) -> throughput.Replay:
    """The model's step time for the run's own layout (with nanotron's step floors unless
    ``floors`` is false)."""
    return throughput.replay(case(run), coefficients(floors), efficiency=efficiency)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""

    def ranks(x: Sequence[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else math.nan


@dataclass(frozen=True)
class Group:
    """One (model, GPUs) group of the sweep against the model."""

    model: str
    gpus: int
    runs: int
    layouts: int
    held_out: bool
    spearman: float
    median_error: float
    pick_ratio: float
    pick: tuple[int, int, int, int, int]
    best: tuple[int, int, int, int, int]


#: reserved GiB from which a run is near its GPU's capacity (79.6 GiB): every run of at most
#: eight nodes that reserved this much ran over twice as long as the model prices it (the
#: caching allocator frees its cache and retries, which the step model does not price)
NEAR_CAPACITY_GIB = 70.0


def near_capacity(run: SweepRun) -> bool:
    """The run reserved ``NEAR_CAPACITY_GIB`` or more."""
    return (run.reserved_gib or 0.0) >= NEAR_CAPACITY_GIB


def groups(
    efficiency: float | None = None, floors: bool = True, without_near_capacity: bool = False
) -> list[Group]:
    """Every group of at least ``MIN_LAYOUTS`` distinct priced layouts, by GPUs then model
    (``without_near_capacity``: the runs that reserved ``NEAR_CAPACITY_GIB`` left out)."""
    found: dict[tuple[str, int], list[tuple[SweepRun, throughput.Replay]]] = defaultdict(list)
    for run in runs():
        if priced(run) and not (without_near_capacity and near_capacity(run)):
            found[(run.model, run.gpus)].append((run, replay(run, efficiency, floors)))
    out = []
    for (model, gpus), pairs in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        layouts = {run.layout for run, _ in pairs}
        if len(layouts) < MIN_LAYOUTS:
            continue
        measured = [run.tokens_per_s_per_gpu or 0.0 for run, _ in pairs]
        predicted = [1 / r.predicted_seconds for _, r in pairs]  # the group's tokens are fixed
        pick = max(range(len(pairs)), key=lambda i: predicted[i])
        best = max(range(len(pairs)), key=lambda i: measured[i])
        out.append(
            Group(
                model=model,
                gpus=gpus,
                runs=len(pairs),
                layouts=len(layouts),
                held_out=pairs[0][0].held_out,
                spearman=spearman(predicted, measured),
                median_error=statistics.median(r.error for _, r in pairs),
                pick_ratio=measured[pick] / measured[best],
                pick=pairs[pick][0].layout,
                best=pairs[best][0].layout,
            )
        )
    return out


def memory_error(run: SweepRun) -> float:
    """(predicted - measured) / measured of the run's reserved peak. The figure's memory is
    world rank 0's ``torch.cuda.max_memory_reserved()`` (nanotron's ``log_throughput`` writes
    the row from rank 0): the first pipeline stage's, so the first stage's estimate."""
    c = case(run)
    train = throughput.train_spec(c).model_copy(
        update={"micro_batch_size": run.micro_batch, "grad_accum_steps": run.grad_accum}
    )
    first = stage_peaks(planner.load_model(c["model_spec"]), train, planner.gpu("H100-80GB"))[0]
    measured = (run.reserved_gib or 0.0) * 2**30
    return (first.reserved_bytes - measured) / measured


@dataclass(frozen=True)
class MemoryRow:
    """The sweep's reserved peaks against the estimate, by how the runs split the model."""

    kind: str
    runs: int
    median_error: float
    p10: float
    p90: float


#: how a run splits the model: (TP > 1, PP > 1)
_KINDS = {(False, False): "dp", (True, False): "tp", (False, True): "pp", (True, True): "tp+pp"}


def memory_rows() -> list[MemoryRow]:
    """Every priced run's memory error, by parallelism kind (data only, TP, PP, both)."""
    kinds: dict[str, list[float]] = defaultdict(list)
    for run in runs():
        if priced(run) and run.reserved_gib is not None:
            kind = _KINDS[(run.tp > 1, run.pp > 1)]
            kinds[kind].append(memory_error(run))
    out = []
    for kind in _KINDS.values():
        e = sorted(kinds[kind])
        out.append(
            MemoryRow(kind, len(e), statistics.median(e), e[len(e) // 10], e[9 * len(e) // 10])
        )
    return out


def one_node_fit_runs() -> list[SweepRun]:
    """The runs that fit the H100's compute efficiency: priced, not held out, on one node (no
    collective crosses the network the model prices least well)."""
    per_node = load()["gpus_per_node"]
    return [r for r in runs() if priced(r) and not r.held_out and r.gpus <= per_node]


def source_errors(
    efficiency: float, ids: Sequence[str], sweep_runs: Sequence[SweepRun]
) -> dict[str, float]:
    """Each source's median error at a GPU ``compute_efficiency``: the throughput cases
    ``ids`` (``published-throughput.json``) by their stack, and the sweep's runs."""
    by: dict[str, list[float]] = defaultdict(list)
    cases = throughput.cases_by_id()
    for i in ids:
        by[cases[i]["stack"]].append(throughput.replay(cases[i], efficiency=efficiency).error)
    for run in sweep_runs:
        by["nanotron"].append(replay(run, efficiency).error)
    return {source: statistics.median(errors) for source, errors in sorted(by.items())}


def fit_gpu_efficiency(ids: Sequence[str], sweep_runs: Sequence[SweepRun]) -> float:
    """The GPU ``compute_efficiency`` at which the sources' median errors average zero, each
    source weighing the same however many runs it has (bisection: the predicted time falls as
    the efficiency rises)."""
    lo, hi = 0.05, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if statistics.fmean(source_errors(mid, ids, sweep_runs).values()) > 0:
            lo = mid  # predicted slower than measured: more efficiency
        else:
            hi = mid
    return (lo + hi) / 2


def _layout(lay: tuple[int, int, int, int, int]) -> str:
    dp, tp, pp, mb, zero = lay
    return f"dp{dp} tp{tp} pp{pp} mb{mb} z{zero}"


def render(rows: Sequence[Group]) -> str:
    lines = [
        f"{'model':6s} {'GPUs':>4s} {'split':8s} {'runs':>4s} {'rho':>6s} {'median err':>10s} "
        f"{'pick/best':>9s}  {'model picks':22s} {'fastest measured':22s}"
    ]
    for g in rows:
        lines.append(
            f"{g.model:6s} {g.gpus:4d} {'held_out' if g.held_out else 'fit':8s} {g.runs:4d} "
            f"{g.spearman:+6.2f} {100 * g.median_error:+9.1f}% {g.pick_ratio:9.2f}  "
            f"{_layout(g.pick):22s} {_layout(g.best):22s}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the groups as JSON")
    parser.add_argument(
        "--memory", action="store_true", help="the reserved peaks against the estimate instead"
    )
    parser.add_argument(
        "--no-floors", action="store_true", help="price without nanotron's step floors"
    )
    parser.add_argument(
        "--without-near-capacity",
        action="store_true",
        help=f"leave out the runs that reserved {NEAR_CAPACITY_GIB:g} GiB or more",
    )
    args = parser.parse_args(argv)
    if args.memory:
        mem = memory_rows()
        if args.json:
            print(json.dumps([asdict(m) for m in mem], indent=1))
        else:
            print(f"{'kind':6s} {'runs':>5s} {'median':>8s} {'p10':>8s} {'p90':>8s}")
            for m in mem:
                print(
                    f"{m.kind:6s} {m.runs:5d} {100 * m.median_error:+7.1f}% "
                    f"{100 * m.p10:+7.1f}% {100 * m.p90:+7.1f}%"
                )
        return 0
    rows = groups(floors=not args.no_floors, without_near_capacity=args.without_near_capacity)
    if args.json:
        print(json.dumps([asdict(g) for g in rows], indent=1))
    else:
        print(render(rows))
        if not args.no_floors:
            fl = fit_step_floors()
            print(
                "\nnanotron's step floors (fit_step_floors): "
                f"{1e3 * fl['tp_host_layer_seconds']:.2f} ms per layer-pass under TP; "
                f"{1e3 * fl['pp_cross_node_layer_seconds']:.2f} + "
                f"{1e3 * fl['pp_cross_node_layer_seconds_per_tp']:.2f} x tp ms where the "
                "pipeline crosses nodes"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
