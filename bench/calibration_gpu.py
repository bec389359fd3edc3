"""The GPU calibration matrix: run the bundled trainer on one GPU over >= 30 configurations and
compare each probe with the estimate (needs a CUDA device; ``--dry-run`` lists the design and
its predictions on any machine).

The design: dense and MoE runtime models; recompute none, selective, every-K and full; offload
none, optimizer 0.5 and 1, and streaming; micro-batch 1-8; sequence 512-8192; plus a cliff set
whose micro-batch sweeps the prediction across the card's capacity. Each configuration runs
``headroom calibrate run MODEL --train PLAN --gpu-probe`` (which stores a ``runtime``
calibration record) and the results go to ``calibration/data/gpu-<gpu>.json``: predicted and
measured peaks, reserved bytes, the attribution and the exit code. The summary: median and max
|error| of the peak over the runs that completed, and false fits (predicted to fit, ran out of
memory).

Run: .venv/bin/python bench/calibration_gpu.py --gpu H200-141GB [--dry-run] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import planner

ROOT = Path(__file__).resolve().parents[1]
DENSE = {
    "name": "gpu-dense-2b",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "num_layers": 16,
    "num_heads": 16,
    "num_kv_heads": 8,
    "ffn_hidden_size": 5632,
}
MOE = {
    **DENSE,
    "name": "gpu-moe-3b",
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


def design(gpu: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, model dict, train dict) of every configuration, the cliff set last."""
    out = []
    for model in (DENSE, MOE):
        for i, offload in enumerate(PLACEMENTS):
            for j, recompute in enumerate(RECOMPUTE):
                mb, seq = SHAPES[(i + j) % len(SHAPES)]
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
    hw = planner.load_hardware(gpu)
    for mb in range(10, 17):  # the cliff: predictions from below to above capacity
        train = {"micro_batch_size": mb, "seq_len": 4096, "activation_profile": "runtime"}
        budget = planner.estimate(planner.load_model(DENSE), planner.load_train(train), hw)
        label = f"cliff {mb}x4096 ({budget.gpu_peak_bytes / hw.memory_bytes:.0%} of capacity)"
        out.append((label, DENSE, train))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", default="H200-141GB")
    parser.add_argument("--dry-run", action="store_true", help="List the design; run nothing.")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    hw = planner.load_hardware(args.gpu)
    configs = design(args.gpu)[: args.limit]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model, train in configs:
            budget = planner.estimate(planner.load_model(model), planner.load_train(train), hw)
            row: dict[str, Any] = {
                "label": label,
                "model": model,
                "train": train,
                "predicted_peak_bytes": budget.gpu_peak_bytes,
                "predicted_fits": budget.fits,
            }
            if not args.dry_run:
                model_file, train_file = Path(tmp) / "model.json", Path(tmp) / "train.json"
                model_file.write_text(json.dumps(model))
                train_file.write_text(json.dumps(train))
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "headroom",
                        "calibrate",
                        "run",
                        str(model_file),
                        "--train",
                        str(train_file),
                        "--gpu",
                        args.gpu,
                        "--gpu-probe",
                        "--format",
                        "json",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=1800,
                )
                row["exit_code"] = proc.returncode
                if proc.stdout.strip():
                    row["outcome"] = json.loads(proc.stdout)["outcome"]
                else:
                    row["error"] = proc.stderr.strip().splitlines()[-1:]
            results.append(row)
            print(
                f"{label:55} predicted {budget.gpu_peak_bytes / 2**30:8.2f} GiB "
                f"fits={budget.fits}"
                + (f" exit={row.get('exit_code')}" if not args.dry_run else "")
            )
    print(f"{len(results)} configurations")
    if args.dry_run:
        return
    done = [r for r in results if r.get("exit_code") == 0 and r["outcome"]["measured_peak_bytes"]]
    errors = [
        abs(r["predicted_peak_bytes"] / r["outcome"]["measured_peak_bytes"] - 1) for r in done
    ]
    false_fits = sum(1 for r in results if r["predicted_fits"] and r.get("exit_code") == 3)
    summary = {
        "gpu": args.gpu,
        "configurations": len(results),
        "completed": len(done),
        "median_error": statistics.median(errors) if errors else None,
        "max_error": max(errors) if errors else None,
        "false_fits": false_fits,
    }
    out = ROOT / "calibration" / "data" / f"gpu-{args.gpu.lower()}.json"
    out.write_text(
        json.dumps(
            {"summary": summary, "command": " ".join(sys.argv), "results": results}, indent=1
        )
        + "\n"
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
