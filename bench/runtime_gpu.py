"""Runtime measurements on a CUDA GPU (refuses to run without one).

1. Link microbenchmark: host→device and device→host copies, pinned vs pageable, by size.
2. CPU AdamW throughput (parameters per second) of ``runtime.adam.adamw_step`` on this host.
3. Full streaming steps against the bound max(compute, link bytes / measured bandwidth, CPU
   optimizer time), with and without prefetching (the double-buffering ablation).
4. Capacity under ``torch.cuda.set_per_process_memory_fraction``: the largest model of a
   family the reference trains versus the largest the streaming trainer trains, same cap.

Run: .venv/bin/python bench/runtime_gpu.py [--quick] [--json OUT]
Every number printed is measured here; nothing is assumed. Results go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import planner
from planner.model import ModelSpec
from runtime.adam import AdamWConfig, adamw_step
from runtime.trainer import RunConfig, train_model

MiB = 1 << 20


def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeat: int) -> float:
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def link(sizes_mib: list[int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes_mib:
        n = size * MiB
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            h2d = _time_copy(dev, host, 5)
            d2h = _time_copy(host, dev, 5)
            rows.append(
                {
                    "size_mib": size,
                    "pinned": pinned,
                    "h2d_gb_s": n / h2d / 1e9,
                    "d2h_gb_s": n / d2h / 1e9,
                }
            )
    return rows


def cpu_adam(numel: int) -> float:
    t = [torch.randn(numel) for _ in range(4)]
    cfg = AdamWConfig()
    adamw_step(cfg, 1, t[0], t[1], t[2], t[3].abs())
    start = time.perf_counter()
    for step in range(2, 5):
        adamw_step(cfg, step, t[0], t[1], t[2], t[3].abs())
    return 3 * numel / (time.perf_counter() - start)


def _scaled(base: ModelSpec, layers: int, hidden: int) -> ModelSpec:
    heads = max(1, hidden // 128)
    return base.model_copy(
        update={
            "name": f"{base.name}-h{hidden}-l{layers}",
            "hidden_size": hidden,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": max(1, heads // 4),
            "ffn_hidden_size": int(hidden * 8 / 3) // 64 * 64,
        }
    )


def steps_vs_bound(spec: ModelSpec, seq: int, link_gb_s: float, adam_rate: float) -> dict[str, Any]:
    out: dict[str, Any] = {"model": spec.name, "params": planner.count_params(spec).total}
    hw = planner.gpu("H200-141GB")
    for prefetch in (True, False):
        train = planner.TrainSpec(
            micro_batch_size=1,
            seq_len=seq,
            offload={"mode": "streaming", "checkpoint_every": 1},
        )
        cfg = RunConfig(steps=4, device="cuda", dtype=torch.bfloat16, prefetch=prefetch)
        result = train_model(spec, train, cfg)
        step_s = result.seconds / result.steps
        n = out["params"]
        compute = 8 * n * seq / (hw.bf16_flops * 0.45)  # forward twice + backward, recomputed
        transfer = n * (2 * 2 + 2) / (link_gb_s * 1e9)
        cpu = n / adam_rate
        bound = max(compute, transfer, cpu)
        out["prefetch" if prefetch else "no_prefetch"] = {
            "step_seconds": step_s,
            "bound_seconds": bound,
            "ratio_to_bound": step_s / bound,
            "bound_parts": {"compute": compute, "transfer": transfer, "cpu_optimizer": cpu},
        }
    return out


def _fits(spec: ModelSpec, streaming: bool) -> bool:
    offload = {"mode": "streaming", "checkpoint_every": 1} if streaming else {"mode": "none"}
    train = planner.TrainSpec(micro_batch_size=1, seq_len=1024, offload=offload)
    cfg = RunConfig(steps=2, device="cuda", dtype=torch.bfloat16)
    try:
        train_model(spec, train, cfg)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def capacity(fraction: float, hidden: int) -> dict[str, Any]:
    torch.cuda.set_per_process_memory_fraction(fraction)
    base = planner.load_model("tiny-dense")
    largest = {}
    for streaming in (False, True):
        best = 0
        layers = 2
        while layers <= 512:
            spec = _scaled(base, layers, hidden)
            if not _fits(spec, streaming):
                break
            best = planner.count_params(spec).total
            layers *= 2
        largest["streaming" if streaming else "reference"] = best
    torch.cuda.set_per_process_memory_fraction(1.0)
    largest["ratio"] = largest["streaming"] / max(largest["reference"], 1)
    largest["memory_fraction"] = fraction
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/runtime_gpu.py needs a CUDA GPU; this machine has none")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    results["link"] = link([1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024])
    pinned = [r for r in results["link"] if r["pinned"] and r["size_mib"] >= 64]
    link_gb_s = min(r["h2d_gb_s"] for r in pinned) if pinned else results["link"][-2]["h2d_gb_s"]
    results["cpu_adam_params_per_s"] = cpu_adam(16 * MiB if args.quick else 256 * MiB)
    base = planner.load_model("tiny-dense")
    spec = _scaled(base, 8 if args.quick else 32, 2048 if args.quick else 4096)
    results["steps"] = steps_vs_bound(
        spec, 1024 if args.quick else 4096, link_gb_s, results["cpu_adam_params_per_s"]
    )
    results["capacity"] = capacity(0.1 if args.quick else 0.25, 1024 if args.quick else 4096)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
