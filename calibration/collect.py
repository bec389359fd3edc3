"""Trace the designs the shipped ``runtime`` and ``hf`` coefficients are fitted from, and write
them to ``calibration/data/<impl>-traces.json``.

The designs are data (``calibration/designs/<impl>.json``, read by ``calibration.design``):
each shape says why it is in the design and each run whether it is fitted or held out.

- ``runtime``: the trainer's model, under fake tensors, varying width, FFN width, heads and KV
  heads, vocabulary, depth, MoE, micro-batch, sequence length and recompute. Each record keeps
  the peak inside a decoder layer's backward too, which the layers' backward terms are fitted
  to.
- ``hf``: transformers models (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe,
  deepseek_v3) built from configs with random weights, traced under fake tensors.

bf16 working parameters throughout (the trainer's GPU precision), torch AdamW (fused, the
spec's default). Fitting uses the records not held out; the tests check the others against
the fitted estimate.

Run: .venv/bin/python -m headroom.calibration.collect [--impl runtime|hf] [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from pathlib import Path

import torch

from headroom import planner
from headroom.calibration.design import IMPLS, configurations
from headroom.calibration.trace_records import TracePeak, TraceRecord, TracesFile, traces_path
from headroom.calibration.tracing import layer_backward_peak, steady_forward_transient, trace


def record(
    model: planner.ModelSpec, train: planner.TrainSpec, held_out: bool, impl: str = "runtime"
) -> TraceRecord:
    """Trace one configuration of a design."""
    measured = trace(model, train, impl=impl)
    return TraceRecord(
        model=model,
        train=train,
        held_out=held_out,
        mode=measured["mode"],
        forward_transient_bytes=steady_forward_transient(measured),
        peak_bytes=measured["peak"]["total"],
        layer_backward_peak_bytes=layer_backward_peak(measured),
        peak=TracePeak.model_validate(measured["peak"]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=IMPLS, default="runtime")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    output = args.output or traces_path(args.impl)
    torch.set_num_threads(1)
    records = [record(m, t, h, args.impl) for m, t, h in configurations(args.impl)]
    transformers_version = None
    if args.impl == "hf":
        import transformers

        transformers_version = transformers.__version__
    traces = TracesFile(
        about=f"Traced training steps ({args.impl} implementation, calibration/tracing.py); "
        f"the shipped '{args.impl}' coefficients are fitted from the records not held out.",
        command=f"python -m headroom.calibration.collect --impl {args.impl}",
        torch=torch.__version__,
        python=platform.python_version(),
        created=dt.datetime.now(dt.UTC).date().isoformat(),
        records=tuple(records),
        transformers=transformers_version,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(traces.to_json_text())
    print(f"{len(records)} records → {output}")


if __name__ == "__main__":
    main()
