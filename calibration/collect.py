"""Trace the design of runtime configurations that the shipped ``runtime`` coefficients are
fitted from, and write them to ``calibration/data/runtime-traces.json``.

The design varies width, FFN width, heads and KV heads, vocabulary, depth, MoE, micro-batch and
sequence length, with bf16 working parameters (the trainer's GPU precision). Every third
configuration is marked held out: fitting uses the others, and the tests check the held-out
ones against the fitted estimate.

Run: .venv/bin/python -m calibration.collect [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from pathlib import Path
from typing import Any

import torch

import planner
from calibration.trace import trace

OUTPUT = Path(__file__).resolve().parent / "data" / "runtime-traces.json"
PURE_BF16 = {"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"}

#: (hidden, heads, kv heads, ffn, vocab, layers, moe)
SHAPES: list[tuple[int, int, int, int, int, int, dict[str, Any] | None]] = [
    (64, 4, 2, 176, 512, 4, None),
    (128, 8, 4, 256, 1000, 2, None),
    (96, 6, 2, 320, 768, 3, None),
    (128, 4, 4, 384, 2048, 2, None),
    (64, 2, 1, 128, 4096, 2, None),
    (160, 10, 10, 448, 640, 3, None),
    (64, 4, 2, 176, 512, 2, {"num_experts": 4, "top_k": 2, "expert_ffn_size": 96}),
    (
        96,
        6,
        3,
        256,
        1024,
        2,
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64, "num_shared_experts": 1},
    ),
]
BATCHES = [(1, 64), (2, 128), (4, 32)]


def design() -> list[tuple[planner.ModelSpec, planner.TrainSpec]]:
    base = planner.load_model("tiny-dense").model_dump()
    out = []
    for i, (hidden, heads, kv, ffn, vocab, layers, moe) in enumerate(SHAPES):
        model = planner.ModelSpec.model_validate(
            {
                **base,
                "name": f"trace-{i}",
                "hidden_size": hidden,
                "num_heads": heads,
                "num_kv_heads": kv,
                "ffn_hidden_size": ffn,
                "vocab_size": vocab,
                "num_layers": layers,
                "moe": moe,
                "source": "calibration design (calibration/collect.py)",
            }
        )
        for mb, seq in BATCHES:
            train = planner.TrainSpec.model_validate(
                {
                    "micro_batch_size": mb,
                    "seq_len": seq,
                    "precision": PURE_BF16,
                    "activation_profile": "runtime",
                }
            )
            out.append((model, train))
    return out


def record(model: planner.ModelSpec, train: planner.TrainSpec, index: int) -> dict[str, Any]:
    measured = trace(model, train)
    forward = [p for p in measured["phases"] if p["phase"] == "forward" and p["step"] == 2]
    return {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "held_out": index % 3 == 2,
        "mode": measured["mode"],
        "forward_transient_bytes": forward[0]["transient"],
        "peak_bytes": measured["peak"]["total"],
        "peak": measured["peak"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = [record(m, t, i) for i, (m, t) in enumerate(design())]
    payload = {
        "about": "Traced training steps of the runtime's model (calibration/trace.py); the "
        "shipped 'runtime' coefficients are fitted from the records not held out.",
        "command": "python -m calibration.collect",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "created": dt.datetime.now(dt.UTC).date().isoformat(),
        "records": records,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(records)} records → {args.output}")


if __name__ == "__main__":
    main()
