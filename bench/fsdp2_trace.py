"""FSDP2 traces of Llama 3 8B's width on a CPU, and what the planner estimates for them.

Traces Llama 3 8B's decoder layers (4096 hidden, 14336 FFN, 32 heads over 8 KV heads,
128256-token vocabulary) cut to ``--layers`` layers under FSDP2 as torchtitan runs it
(``calibration.frameworks.fsdp2``: fake tensors, rank 0 of a fake process group) at each
``--world-sizes`` data-parallel size, with and without per-layer checkpointing, and prints the
seconds each trace took, the traced peak per phase and the planner's estimate of the same run
(``framework: fsdp2``, ``activation_profile: hf``, ``parallel: {dp: W, zero_stage: 3}``,
torchtitan's precision; the
allocated buckets of its peak phase, no CUDA context or allocator overhead).

``--records`` prints, instead of tracing, the planner's error on every committed FSDP2 record
(``calibration/data/hf-fsdp2-traces.json``, and ``torchtitan-fsdp2-traces.json``: torchtitan's
own model under its own ``parallelize_llama``, estimated with ``fsdp2.groups: split`` and the
``torchtitan`` profile): the peak under ``framework: fsdp2`` (the records'
own spec), the largest a decoder layer's backward holds, and the peak estimated as plain ZeRO-3
(``framework: none``) beside it.

Run: .venv/bin/python bench/fsdp2_trace.py [--layers 1 2] [--world-sizes 8 64 256]
[--seq-len 8192] [--records]
"""

from __future__ import annotations

import argparse
import time

import torch

from headroom import planner
from headroom.calibration.comparison import compare_trace
from headroom.calibration.design import FRAMEWORK_DESIGNS, FSDP2_PRECISION
from headroom.calibration.trace_records import load_framework_traces

GIB = 2**30
HARDWARE = "H100-80GB"  # only the verdict's capacity; the compared bytes exclude the card's own
LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _train(dp: int, tp: int, seq_len: int, recompute: str) -> planner.TrainSpec:
    return planner.TrainSpec.model_validate(
        {
            "micro_batch_size": 1,
            "seq_len": seq_len,
            "recompute": recompute,
            "framework": "fsdp2",
            "precision": FSDP2_PRECISION,
            "activation_profile": "hf",
            "parallel": {"dp": dp, "tp": tp, "zero_stage": 3, "sequence_parallel": tp > 1},
        }
    )


def _estimate(model: planner.ModelSpec, train: planner.TrainSpec, peak: dict[str, int]) -> str:
    out = compare_trace(planner.estimate(model, train, planner.gpu(HARDWARE)), {"peak": peak})
    return (
        f"planner {out['predicted']['total'] / GIB:7.3f} GiB ({out['phase']}, "
        f"{out['error']['total']:+.1%})"
    )


def trace_table(layers: list[int], world_sizes: list[int], seq_len: int) -> None:
    from headroom.calibration import hf
    from headroom.calibration.frameworks import fsdp2

    for count in layers:
        config = {**LLAMA3_8B, "num_hidden_layers": count, "_name_or_path": f"llama3-8b-{count}l"}
        model = hf.spec_of(config)
        for recompute in ("none", "full"):
            for dp in world_sizes:
                train = _train(dp, 1, seq_len, recompute)
                start = time.perf_counter()
                measured = fsdp2.trace(model, train, config=config)
                seconds = time.perf_counter() - start
                phases = measured["phases"]
                print(
                    f"{count} layer(s) W={dp:<4d} {recompute:4s} {seconds:5.2f} s  traced "
                    f"{measured['peak']['total'] / GIB:7.3f} GiB ({measured['peak_phase']})  "
                    + _estimate(model, train, measured["peak"])
                )
                print(
                    "    "
                    + ", ".join(f"{name} {p['total'] / GIB:.3f}" for name, p in phases.items())
                )


def records_table() -> None:
    for design in FRAMEWORK_DESIGNS:
        print(f"{design}:")
        _design_table(design)


def _design_table(design: str) -> None:
    from headroom.planner.estimator import layer_backward_bytes

    traces = load_framework_traces(design)
    assert traces is not None, f"no committed traces of {design}"
    errors: dict[bool, list[float]] = {True: [], False: []}
    for r in traces.records:
        p = r.train.parallel
        assert r.peak is not None and r.layer_backward_peak_bytes is not None
        peak = r.peak.model_dump()
        error = compare_trace(
            planner.estimate(r.model, r.train, planner.gpu(HARDWARE)), {"peak": peak}
        )
        errors[r.held_out].append(error["error"]["total"])
        plain = r.train.model_copy(update={"framework": "none"})
        layer = layer_backward_bytes(r.model, r.train) / r.layer_backward_peak_bytes - 1
        print(
            f"{r.model.name:16s} dp {p.dp:<4d}tp {p.tp} {r.train.recompute:4s} "
            f"{r.train.micro_batch_size}x{r.train.seq_len:<5d} "
            f"{'held out' if r.held_out else 'design  '} traced {r.peak_bytes / GIB:7.3f} GiB "
            f"({r.peak_phase})  "
            + _estimate(r.model, r.train, peak)
            + f"  layer backward {layer:+.1%}  as none: "
            + _estimate(r.model, plain, peak).split("(")[-1].rstrip(")")
        )
    for held_out, values in errors.items():
        magnitudes = sorted(abs(v) for v in values)
        print(
            f"{'held out' if held_out else 'design  '}: {len(values)} records, "
            f"{min(values):+.1%} … {max(values):+.1%}, median |error| "
            f"{magnitudes[len(magnitudes) // 2]:.2%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--records", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.records:
        records_table()
    else:
        trace_table(args.layers, args.world_sizes, args.seq_len)


if __name__ == "__main__":
    main()
