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
- ``megatron``: Megatron-Core's GPT with its local layers (``calibration.megatron``) in the
  families its arguments make (SwiGLU or GeLU, RMSNorm or LayerNorm, biases, dropout, grouped
  or multi-head attention), on rank 0 of 1, 2 or 4 tensor-parallel ranks with and without
  sequence parallelism, and under its recompute (selective, full, uniform groups).
- ``torchtitan``: torchtitan's own Llama 3 model code (``calibration.torchtitan``), dense
  widths of 512 to 3072 and two-layer cuts of its 8B and 70B flavors, with and without
  torchtitan's full activation checkpointing.

bf16 working parameters throughout (the trainer's GPU precision), torch AdamW (fused, the
spec's default). Fitting uses the records not held out; the tests check the others against
the fitted estimate.

- ``--impl hf --framework fsdp2``: transformers llama and qwen2 models at published widths and
  a few layers, traced under FSDP2 as torchtitan runs it (``calibration.frameworks.fsdp2``) on
  rank 0 of a fake process group of 8 to 256 data-parallel ranks, with and without tensor
  parallelism and per-layer checkpointing; written to ``hf-fsdp2-traces.json`` with each
  phase's tracker categories.
- ``--impl torchtitan --framework fsdp2``: torchtitan's own Llama 3 flavors cut to a few layers,
  parallelized by torchtitan's own ``parallelize_llama`` (its FSDP grouping, ``FullAC``) on rank
  0 of 8 to 256 ranks, with and without its own tensor-parallel plan; written to
  ``torchtitan-fsdp2-traces.json``.

Run: .venv/bin/python -m headroom.calibration.collect [--impl runtime|hf|torchtitan|megatron]
[--framework none|fsdp2] [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from importlib.metadata import version as _version
from pathlib import Path

import torch

from headroom import planner
from headroom.calibration.design import IMPLS, configurations
from headroom.calibration.frameworks import FRAMEWORKS, check_framework, design_name
from headroom.calibration.trace_records import (
    PACKAGES,
    FrameworkTraceRecord,
    FrameworkTracesFile,
    TracePeak,
    TraceRecord,
    TracesFile,
    traces_path,
)
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
        # none where the tracker sees no layer's backward (Megatron's reentrant checkpoint
        # re-runs its layers inside its own backward)
        layer_backward_peak_bytes=layer_backward_peak(measured) or None,
        peak=TracePeak.model_validate(measured["peak"]),
    )


def fsdp2_record(
    model: planner.ModelSpec, train: planner.TrainSpec, held_out: bool, impl: str = "hf"
) -> FrameworkTraceRecord:
    """Trace one configuration of the ``hf-fsdp2`` or ``torchtitan-fsdp2`` design."""
    from headroom.calibration.frameworks import fsdp2

    measured = fsdp2.trace(model, train, impl=impl)
    layers = measured["layer_backward_peaks"]
    return FrameworkTraceRecord(
        model=model,
        train=train,
        held_out=held_out,
        mode=measured["mode"],
        forward_transient_bytes=fsdp2.transient_bytes(measured["forward_end"]),
        peak_bytes=measured["peak"]["total"],
        layer_backward_peak_bytes=max((p["total"] for p in layers), default=None),
        peak=TracePeak.model_validate(measured["peak"]),
        peak_phase=measured["peak_phase"],
        phases=measured["phases"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=IMPLS, default="runtime")
    parser.add_argument("--framework", choices=FRAMEWORKS, default="none")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    try:
        check_framework(args.framework, args.impl)
    except planner.SpecError as exc:
        parser.error(str(exc))
    name = design_name(args.impl, args.framework)
    # the version of the model code's package the traces were made with
    package = PACKAGES.get(args.impl)
    versions = {package[0]: _version(package[1])} if package else {}
    output = args.output or traces_path(name)
    torch.set_num_threads(1)
    if args.framework == "fsdp2":
        traced = [fsdp2_record(m, t, h, args.impl) for m, t, h in configurations(name)]
        what = (
            "torchtitan's own Llama 3 parallelized by torchtitan's own parallelize_llama"
            if args.impl == "torchtitan"
            else "transformers models under FSDP2 as torchtitan runs it"
        )
        framework_traces = FrameworkTracesFile(
            about=f"Traced training steps of {what}, on rank 0 of a fake process group "
            "(calibration/frameworks/fsdp2.py); per phase, the FSDP memory tracker's "
            "categories at the phase's largest total.",
            command=f"python -m headroom.calibration.collect --impl {args.impl} "
            f"--framework {args.framework}",
            torch=torch.__version__,
            python=platform.python_version(),
            created=dt.datetime.now(dt.UTC).date().isoformat(),
            records=tuple(traced),
            framework=args.framework,
            **versions,
        )
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(framework_traces.to_json_text())
        print(f"{len(traced)} records → {output}")
        return
    records = [record(m, t, h, args.impl) for m, t, h in configurations(args.impl)]
    traces = TracesFile(
        about=f"Traced training steps ({args.impl} implementation, calibration/tracing.py); "
        f"the shipped '{args.impl}' coefficients are fitted from the records not held out.",
        command=f"python -m headroom.calibration.collect --impl {args.impl}",
        torch=torch.__version__,
        python=platform.python_version(),
        created=dt.datetime.now(dt.UTC).date().isoformat(),
        records=tuple(records),
        **versions,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(traces.to_json_text())
    print(f"{len(records)} records → {output}")


if __name__ == "__main__":
    main()
