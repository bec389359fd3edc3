"""The GPU calibration matrix's design on a CPU: the bundled trainer under the simulated device
cap (``runtime.cap.DeviceCap``), against the planner's allocated bytes.

The GPU matrix (``bench/calibration_gpu.py``) needs a card. This runs its grid (dense and MoE;
offload none, optimizer 0.5 and 1, streaming; recompute none, selective, every-2 and full;
micro-batch 1-8) with the models cut to ``--width`` and the sequences divided by ``--seq-div``,
in bf16 with fp32 master weights, as the GPU matrix trains. The cap counts every live device
storage exactly, so the comparison is the planner's allocated peak (every bucket but
``cuda_context`` and ``allocator_overhead``) with the trainer's, the allocator's rounding and
caching aside; it catches a trainer that holds what the planner does not count, or a planner
term that is wrong, before a GPU is spent on it.

``--states`` runs the state variants instead: 16-bit moments, fp32 gradient accumulation, the
EMA on the device or the host, and pure bf16 (no master), under each placement they allow.

Run: .venv/bin/python bench/calibration_sim.py [--width 256] [--seq-div 8] [--states] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from headroom import planner
from headroom.calibration.comparison import NOT_ALLOCATED

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_gpu import DENSE, MOE, grid

sys.path.pop(0)

HARDWARE = "H200-141GB"  # only the verdict's capacity; the compared bytes exclude the card's own


def scaled(model: dict[str, Any], width: int) -> dict[str, Any]:
    """``model`` at ``width`` (heads of 64, FFN and expert widths scaled with it)."""
    ratio = width / model["hidden_size"]
    heads = max(2, width // 64)
    out = {
        **model,
        "name": f"{model['name']}-w{width}",
        "hidden_size": width,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // 2),
        "ffn_hidden_size": int(model["ffn_hidden_size"] * ratio) // 8 * 8,
        "vocab_size": max(1024, int(model["vocab_size"] * ratio) // 64 * 64),
        "num_layers": min(model["num_layers"], 4),
    }
    if model.get("moe"):
        moe = model["moe"]
        out["moe"] = {**moe, "expert_ffn_size": int(moe["expert_ffn_size"] * ratio) // 8 * 8}
        out["num_layers"] = min(model["num_layers"], 2)
    return out


def design(width: int, seq_div: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The GPU matrix's grid (without its cliff set) at ``width`` and ``seq / seq_div``."""
    return grid((scaled(DENSE, width), scaled(MOE, width)), seq_div)


# the state precisions and EMA placements the trainer keeps as the spec says, beside the
# grid's default (bf16 weights and gradients, fp32 master and moments, no EMA)
STATE_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("bf16-moments", {"precision": {"optimizer_states": "bf16"}}),
    ("fp32-grads", {"precision": {"grads": "fp32"}}),
    ("ema-gpu", {"ema": "gpu"}),
    ("ema-host", {"ema": "host"}),
    ("pure-bf16", {"precision": {"master": "none", "optimizer_states": "bf16"}}),
]
STATE_PLACEMENTS: list[dict[str, Any]] = [
    {"mode": "none"},
    {"mode": "optimizer", "fraction": 0.5},
    {"mode": "streaming", "checkpoint_every": 1},
]


def state_design(width: int, seq_len: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Every state variant under every placement it allows (no master: resident only), dense
    and MoE, micro-batches of two ``seq_len`` sequences; the fp32 gradients also with
    accumulation and with tied embeddings."""
    dense = scaled(DENSE, width)
    tied = {**dense, "name": f"{dense['name']}-tied", "tied_embeddings": True}
    out = []
    for model in (dense, tied, scaled(MOE, width)):
        for name, extra in STATE_VARIANTS:
            if model is tied and name != "fp32-grads":
                continue  # the tied table's gradients at the end of backward: fp32 grads only
            for offload in STATE_PLACEMENTS:
                if "master" in extra.get("precision", {}) and offload["mode"] != "none":
                    continue  # offloading updates against an fp32 master
                for accum in (1, 2) if name == "fp32-grads" and offload["mode"] == "none" else (1,):
                    train = {
                        "micro_batch_size": 2,
                        "seq_len": seq_len,
                        "grad_accum_steps": accum,
                        "offload": offload,
                        "activation_profile": "runtime",
                        **extra,
                    }
                    label = f"{model['name']} {name} {offload['mode']} accum {accum}"
                    out.append((label, model, train))
    return out


def allocated(budget: planner.Budget) -> dict[str, int]:
    """The planner's allocated bytes per phase: the card's context and allocator slack aside."""
    return {
        name: sum(v for k, v in row.buckets.items() if k not in NOT_ALLOCATED)
        for name, row in budget.gpu.phases.items()
    }


def measure(model: dict[str, Any], train: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    """Train one configuration under the simulated cap; planner and trainer side by side."""
    from headroom.runtime.cap import DeviceCap
    from headroom.runtime.probe import MemoryProbe
    from headroom.runtime.trainer import RunConfig, train_model

    spec, plan = planner.load_model(model), planner.load_train(train)
    predicted = allocated(planner.estimate(spec, plan, planner.load_hardware(HARDWARE)))
    start = time.perf_counter()
    with DeviceCap(1 << 50) as cap:
        probe = MemoryProbe(torch.device("cpu"), cap)
        train_model(spec, plan, RunConfig(steps=steps, dtype=torch.bfloat16), on_phase=probe)
    optimizer = max(s["allocated_peak_bytes"] for s in probe.snapshots if s["phase"] == "optimizer")
    peak = max(predicted.values())
    return {
        "predicted_peak_bytes": peak,
        "measured_peak_bytes": cap.peak_bytes,
        "error": peak / cap.peak_bytes - 1,
        "predicted_optimizer_bytes": predicted["optimizer"],
        "measured_optimizer_bytes": optimizer,
        "seconds": round(time.perf_counter() - start, 2),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows]
    return {
        "configurations": len(rows),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "under_predicted": sum(r["error"] < 0 for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-div", type=int, default=8)
    parser.add_argument(
        "--states",
        action="store_true",
        help="The state-precision and EMA variants instead of the grid (sequence 2048/seq-div).",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'configuration':52} {'predicted':>10} {'measured':>10} {'error':>7}  optimizer")
    if args.states:
        configs = state_design(args.width, 2048 // args.seq_div)
    else:
        configs = design(args.width, args.seq_div)
    for label, model, train in configs:
        row = {"label": label, **measure(model, train)}
        rows.append(row)
        mib = 1 << 20
        opt = row["predicted_optimizer_bytes"] / mib, row["measured_optimizer_bytes"] / mib
        print(
            f"{label:52} {row['predicted_peak_bytes'] / mib:9.2f}M "
            f"{row['measured_peak_bytes'] / mib:9.2f}M {row['error']:+7.2%}  "
            f"{opt[0]:.2f}/{opt[1]:.2f}M",
            flush=True,
        )
    summary = summarise(rows)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
