"""The GPU calibration matrix: run the bundled trainer on one GPU over >= 30 configurations and
compare each probe with the estimate (needs a CUDA device; ``--dry-run`` lists the design and
its predictions on any machine).

The design: dense and MoE runtime models; recompute none, selective, every-K and full; offload
none, optimizer 0.5 and 1, and streaming; micro-batch 1-8; sequence 512-8192; plus a cliff set
whose micro-batch sweeps the prediction across the card's capacity. Each configuration is probed
the way ``headroom calibrate run MODEL --train PLAN --gpu-probe`` probes it (``headroom train``
in a child process under the card's memory cap, stored as a ``runtime`` calibration record),
and the results go to ``calibration/data/gpu-<gpu>.json``: predicted and measured peaks,
reserved bytes, the attribution and the exit code. The summary: median and max |error| of the
peak over the runs that completed, and false fits (predicted to fit, ran out of memory).

The file is rewritten after every configuration and a rerun skips the configurations it already
holds, so the matrix can be measured in pieces (``--budget-s`` stops starting new ones).

Run: .venv/bin/python bench/calibration_gpu.py --gpu H200-141GB [--dry-run] [--limit N]
     [--budget-s SECONDS] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headroom import planner

ROOT = Path(__file__).resolve().parents[1]
DENSE = {
    "name": "gpu-dense-0.9b",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_layers": 16,
    "num_heads": 16,
    "num_kv_heads": 8,
    "ffn_hidden_size": 5632,
}
MOE = {
    **DENSE,
    "name": "gpu-moe-0.85b",
    "num_layers": 8,
    "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_size": 1408, "num_shared_experts": 1},
}
PLACEMENTS: list[dict[str, Any]] = [
    {"mode": "none"},
    {"mode": "optimizer", "fraction": 0.5},
    {"mode": "optimizer", "fraction": 1.0},
    {"mode": "streaming", "checkpoint_every": 2},
]
RECOMPUTE: list[Any] = ["none", "selective", {"every_k": 2}, "full"]
SHAPES = [(1, 8192), (2, 4096), (4, 2048), (8, 512)]
CLIFF = (0.8, 1.2)  # the cliff set's predicted peaks with the margin, as fractions of the card


def grid(
    models: tuple[dict[str, Any], ...], seq_div: int = 1
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, model dict, train dict) of every placement x recompute configuration of
    ``models``, the sequences divided by ``seq_div`` (``bench/calibration_sim.py`` cuts them)."""
    out = []
    for model in models:
        for i, offload in enumerate(PLACEMENTS):
            for j, recompute in enumerate(RECOMPUTE):
                mb, seq = SHAPES[(i + j) % len(SHAPES)]
                seq //= seq_div
                if offload["mode"] == "streaming" and recompute != "none":
                    continue  # streaming recomputes block-wise by itself
                train = {
                    "micro_batch_size": mb,
                    "seq_len": seq,
                    "recompute": recompute,
                    "offload": offload,
                    "activation_profile": "runtime",
                }
                policy = recompute if isinstance(recompute, str) else "every-2"
                label = f"{model['name']} {offload['mode']} {policy} {mb}x{seq}"
                out.append((label, model, train))
    return out


def design(gpu: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, model dict, train dict) of every configuration, the cliff set last."""
    out = grid((DENSE, MOE))
    hw = planner.load_hardware(gpu)
    model = planner.load_model(DENSE)
    # the cliff: every micro-batch (sequence 4096) whose predicted peak with the verdict's
    # margin is 80 % to 120 % of the card, so the set straddles the verdict's cliff whatever
    # the current coefficients and margin
    for mb in range(1, 1025):
        train = {"micro_batch_size": mb, "seq_len": 4096, "activation_profile": "runtime"}
        budget = planner.estimate(model, planner.load_train(train), hw)
        ratio = (budget.gpu_peak_bytes + budget.margin_bytes) / hw.memory_bytes
        if ratio > CLIFF[1]:
            break
        if ratio >= CLIFF[0]:
            out.append((f"cliff {mb}x4096 ({ratio:.0%} of capacity)", DENSE, train))
    return out


# (model dict, train dict, gpu, steps) -> the probe's outcome (ProbeOutcome's JSON)
Runner = Callable[[dict[str, Any], dict[str, Any], str, int], dict[str, Any]]


def probe_on_gpu(
    model: dict[str, Any], train: dict[str, Any], gpu: str, steps: int, device: str = "cuda"
) -> dict[str, Any]:
    """Probe one configuration on this machine's CUDA device and store its record, as
    ``headroom calibrate run --gpu-probe`` does (one PyTorch process per configuration; the
    CPU ``device`` is for tests)."""
    from headroom.launch.probing import subprocess_prober
    from headroom.launch.recording import probe_recorder
    from headroom.store import open_store

    spec, plan, hw = (
        planner.load_model(model),
        planner.load_train(train),
        planner.load_hardware(gpu),
    )
    budget = planner.estimate(spec, plan, hw)
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "model.json"
        model_file.write_text(json.dumps(model))
        prober = subprocess_prober(str(model_file), hw, device, steps, timeout_s=600)
        outcome = prober(plan, budget)
    probe_recorder(open_store(), spec, hw, "runtime")(plan, budget, outcome)
    return outcome.model_dump(mode="json")


def summarise(gpu: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |peak error| over the completed runs; false fits over all of them."""
    done = [r for r in rows if r.get("exit_code") == 0 and r["outcome"].get("measured_peak_bytes")]
    errors = [
        abs(r["predicted_peak_bytes"] / r["outcome"]["measured_peak_bytes"] - 1) for r in done
    ]
    return {
        "gpu": gpu,
        "configurations": len(rows),
        "measured": sum(1 for r in rows if "exit_code" in r),
        "completed": len(done),
        "median_error": statistics.median(errors) if errors else None,
        "max_error": max(errors) if errors else None,
        "false_fits": sum(
            1 for r in rows if r["predicted_fits"] and r.get("outcome", {}).get("oom")
        ),
        "fit_refused_but_ran": sum(
            1 for r in rows if not r["predicted_fits"] and r.get("exit_code") == 0
        ),
    }


def run_matrix(
    gpu: str,
    out: Path,
    runner: Runner,
    *,
    limit: int | None = None,
    budget_s: float | None = None,
    steps: int = 2,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Measure the configurations ``out`` does not hold yet, rewriting it after each one."""
    hw = planner.load_hardware(gpu)
    held = {r["label"]: r for r in _load(out).get("results", []) if "exit_code" in r}
    rows: list[dict[str, Any]] = []
    start = clock()
    for label, model, train in design(gpu)[:limit]:
        if label in held:
            rows.append(held[label])
            continue
        budget = planner.estimate(planner.load_model(model), planner.load_train(train), hw)
        row: dict[str, Any] = {
            "label": label,
            "model": model,
            "train": train,
            "predicted_peak_bytes": budget.gpu_peak_bytes,
            "predicted_phase": budget.peak_phase,
            "predicted_fits": budget.fits,
        }
        if budget_s is None or clock() - start < budget_s:
            began = clock()
            outcome = runner(model, train, gpu, steps)
            row |= {"exit_code": outcome["exit_code"], "outcome": outcome}
            row["seconds"] = round(clock() - began, 1)
            measured = outcome.get("measured_peak_bytes")
            log(
                f"{label:55} predicted {budget.gpu_peak_bytes / 2**30:7.2f} GiB, measured "
                + ("n/a" if measured is None else f"{measured / 2**30:7.2f} GiB")
                + f", exit {outcome['exit_code']} ({row['seconds']} s)"
            )
        rows.append(row)
        _write(out, gpu, rows)
    _write(out, gpu, rows)
    return summarise(gpu, rows)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _write(path: Path, gpu: str, rows: list[dict[str, Any]]) -> None:
    doc = {
        "summary": summarise(gpu, rows),
        "command": f"python bench/calibration_gpu.py --gpu {gpu}",
        "results": rows,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", default="H200-141GB")
    parser.add_argument("--dry-run", action="store_true", help="List the design; run nothing.")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per probe (>= 2)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no configuration after this long"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    hw = planner.load_hardware(args.gpu)
    if args.dry_run:
        configs = design(args.gpu)[: args.limit]
        for label, model, train in configs:
            budget = planner.estimate(planner.load_model(model), planner.load_train(train), hw)
            print(
                f"{label:55} predicted {budget.gpu_peak_bytes / 2**30:8.2f} GiB "
                f"({budget.peak_phase}) fits={budget.fits}"
            )
        print(f"{len(configs)} configurations")
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/calibration_gpu.py needs a CUDA GPU (or --dry-run)")
    out = args.out or ROOT / "calibration" / "data" / f"gpu-{args.gpu.lower()}.json"
    summary = run_matrix(
        args.gpu, out, probe_on_gpu, limit=args.limit, budget_s=args.budget_s, steps=args.steps
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
