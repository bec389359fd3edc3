"""Runtime measurements on a CUDA GPU (refuses to run without one).

Sections (``--only`` picks some; each is written to ``--json`` as soon as it is done, merged
with what the file already holds, so a run cut short keeps what it measured):

- ``link``: host→device and device→host copies, pinned vs pageable, by size.
- ``adam``: CPU AdamW throughput (parameters per second) of ``runtime.adam.adamw_step``, alone
  and writing a bf16 working copy as the streaming trainer's update does.
- ``routing``: an MoE layer's scale of its experts' outputs by fp32 routing weights at
  DeepSeek-V3's slot count, forward and backward, eager autograd against the trainer's slabs:
  time and peak bytes.
- ``steps``: steady streaming steps against the bound max(compute, link bytes / measured
  bandwidth, CPU optimizer time): clipped at 1.0 (the update waits for the step's norm) and
  unclipped (each unit updated as its last gradient lands), and clipped without prefetching
  (the double-buffering ablation); each beside the planner's step model's expectation.
  Compute is measured too: resident steps of the same layer shape with full recompute (what
  streaming computes: forward, recomputed forward, backward) at two depths.
- ``ranks``: the streaming trainer as N data-parallel ranks of one node (``torchrun``, one GPU
  each, N = 1, 2, 4, 8 up to the GPUs present): the step time against the one-rank bound
  ``max(compute, transfer, CPU optimizer / N)`` (each rank computes its own rows over its own
  link and updates ``1/N`` of the state; the collectives on the host are not in the bound, so
  the gap is what they and the shared CPU cost), and the host RAM the node's ranks pinned
  (``placement.host_state_bytes_per_rank``) against the planner's host budget for the node
  (``ranks_sharing`` ranks).
- ``capacity``: under one memory cap (``headroom train --memory-cap``, i.e.
  ``torch.cuda.set_per_process_memory_fraction``), the largest depth the resident trainer fits
  (bisection) against a streaming run of at least ``--ratio`` times its parameters.

Host RAM is checked against the planner's host estimate before any streaming run.

Run: python bench/runtime_gpu.py [--quick] [--only link,adam,routing,steps,ranks,capacity]
[--json OUT]
Every number printed is measured here; nothing is assumed. Results go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from headroom import planner
from headroom.planner.model import ModelSpec
from headroom.planner.steptime import streaming_step_seconds
from headroom.runtime.adam import AdamWConfig, adamw_step
from headroom.runtime.trainer import RunConfig, train_model

MiB = 1 << 20
GiB = 1 << 30
SECTIONS = ("link", "adam", "routing", "steps", "ranks", "capacity")
FP32 = {"params": "fp32", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}


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
            _time_copy(dev, host, 1)  # warm-up
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


def bandwidth(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Pinned H2D and D2H GB/s at the largest size measured (what a layer copy sees)."""
    pinned = [r for r in rows if r["pinned"]]
    top = max(pinned, key=lambda r: r["size_mib"])
    return top["h2d_gb_s"], top["d2h_gb_s"]


def cpu_adam(numel: int, working: torch.dtype | None = None) -> float:
    """CPU AdamW parameters per second; with ``working``, also writing the updated weights in
    that dtype, as the streaming trainer's update does (its bound's CPU time)."""
    master, grad, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    out = None if working is None else torch.empty(numel, dtype=working)
    cfg = AdamWConfig()
    adamw_step(cfg, 1, master, grad, m, v, working=out)
    start = time.perf_counter()
    for step in range(2, 5):
        # the spent gradient serves as the next
        adamw_step(cfg, step, master, grad, m, v, working=out)
    return 3 * numel / (time.perf_counter() - start)


def landing(numel: int) -> dict[str, float]:
    """The streaming host thread's gradient landing, elements per second: a 16-bit gradient
    copied into a pinned slab and moved into its fp32 accumulator, as a unit's first landing
    of a step (a converting copy) and as a later one (an add)."""
    from headroom.runtime.streams import carve, carved_bytes, make_backend
    from headroom.runtime.trainer import HostWork, Unit

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = make_backend(device)
    fields = [(f"slab{i}", numel, torch.bfloat16) for i in range(2)]
    slabs = list(carve(backend.host_buffer(carved_bytes(fields)), fields).values())
    unit = Unit("u", ["w"], [torch.Size([numel])], [0], numel)
    unit.host = {"grad": torch.empty(numel)}
    grad = torch.randn(numel, device=device).bfloat16()
    out = {}
    try:
        with HostWork(backend, slabs) as work:
            for label, first in (("first", True), ("later", False)):
                times = []
                for _ in range(6):
                    if first:
                        work.new_step()
                    start = time.perf_counter()
                    work.land(0, unit, grad, torch.bfloat16)
                    work.drain()
                    times.append(time.perf_counter() - start)
                out[f"{label}_landing_per_s"] = numel / statistics.median(times[1:])
    finally:
        backend.release_host()
    return out


def routing_scale(experts: int, slots: int, width: int, repeats: int = 5) -> dict[str, Any]:
    """An MoE layer's scale of its experts' outputs ``(E, C, width)`` (bf16, transposed as the
    batched experts make them) by fp32 routing weights, forward and backward: eager autograd
    (``(y * w).to(bf16)``) against the trainer's slab-wise ``_ScaleByRoutingWeights``. Median
    seconds, and on CUDA the peak bytes allocated above the inputs."""
    from headroom.runtime.model import _ScaleByRoutingWeights

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"

    def eager(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (y * w.unsqueeze(-1)).to(y.dtype)

    out: dict[str, Any] = {"experts": experts, "slots": slots, "width": width}
    for name, scale in (("eager", eager), ("slabs", _ScaleByRoutingWeights.apply)):
        y = torch.randn(experts, width, slots, device=device, dtype=torch.bfloat16)
        y.requires_grad_()
        w = torch.rand(experts, slots, device=device).requires_grad_()
        grad = torch.randn(experts, slots, width, device=device, dtype=torch.bfloat16)
        times, peak = [], 0
        for _ in range(repeats + 1):
            y.grad = w.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            scale(y.transpose(1, 2), w).backward(grad)
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
            times.append(time.perf_counter() - start)
        out[f"{name}_seconds"] = statistics.median(times[1:])
        if cuda:
            out[f"{name}_peak_bytes"] = peak
    return out


def scaled(layers: int, hidden: int, vocab: int = 32000) -> ModelSpec:
    """The tiny-dense family at ``hidden`` width (head dim 128, 4 query heads per KV head)."""
    base = planner.load_model("tiny-dense")
    heads = max(1, hidden // 128)
    return base.model_copy(
        update={
            "name": f"dense-h{hidden}-l{layers}",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": max(1, heads // 4),
            "ffn_hidden_size": int(hidden * 8 / 3) // 64 * 64,
        }
    )


def host_fits(spec: ModelSpec, train: planner.TrainSpec, host_bytes: int) -> bool:
    budget = planner.estimate(spec, train, planner.gpu("H200-141GB"))
    return budget.host_peak_bytes <= 0.8 * host_bytes


def _steady_step_seconds(spec: ModelSpec, train: planner.TrainSpec, cfg: RunConfig) -> float:
    """Median time between optimizer phases after the first two steps."""
    marks: list[float] = []

    def hook(phase: str, step: int) -> None:
        if phase == "optimizer":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    train_model(spec, train, cfg, on_phase=hook)
    gaps = [b - a for a, b in itertools.pairwise(marks[1:])]
    return statistics.median(gaps)


def steps_vs_bound(
    layers: int,
    hidden: int,
    seq: int,
    link_rows: list[dict[str, Any]],
    adam_rate: float,
    host: int,
    device: str = "cuda",
    vocab: int = 32000,
) -> dict[str, Any]:
    """The ``steps`` section (on a CPU, in fp32, for tests: nothing there is a measurement)."""
    spec = scaled(layers, hidden, vocab)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = planner.count_params(spec).total
    h2d, d2h = bandwidth(link_rows)
    stream = planner.TrainSpec(
        micro_batch_size=1, seq_len=seq, offload={"mode": "streaming", "checkpoint_every": 1}
    )
    out: dict[str, Any] = {"model": spec.name, "params": n, "seq_len": seq}
    if not host_fits(spec, stream, host):
        out["skipped"] = f"host RAM: the plan needs more than 80 % of {host / GiB:.0f} GiB"
        return out
    # compute: resident steps with full recompute at two depths give a layer's time
    resident = planner.TrainSpec(micro_batch_size=1, seq_len=seq, recompute="full")
    cfg = RunConfig(steps=5, device=device, dtype=dtype)
    t2 = _steady_step_seconds(scaled(2, hidden, vocab), resident, cfg)
    t4 = _steady_step_seconds(scaled(4, hidden, vocab), resident, cfg)
    per_layer = (t4 - t2) / 2
    compute = t2 + (layers - 2) * per_layer
    # link: each layer's weights go down twice (forward, recompute) and its gradient up once;
    # the two directions overlap
    transfer = max(2 * 2 * n / (h2d * 1e9), 2 * n / (d2h * 1e9))
    cpu = n / adam_rate
    bound = max(compute, transfer, cpu)
    out["bound_parts"] = {
        "compute": compute,
        "compute_per_layer": per_layer,
        "transfer": transfer,
        "cpu_optimizer": cpu,
    }
    out["bound_seconds"] = bound
    # what the planner's step model expects of each schedule from these measured parts (one
    # micro-batch; its forward is a quarter of forward, recompute and backward)
    forward = compute / 4
    runs = {
        "prefetch": (True, 1.0),  # the default: double-buffered, clipped at 1.0
        "prefetch_unclipped": (True, None),  # updates as gradients land
        "no_prefetch": (False, 1.0),  # the double-buffering ablation
    }
    for label, (prefetch, norm) in runs.items():
        plan = stream.model_copy(update={"max_grad_norm": norm})
        step = _steady_step_seconds(
            spec, plan, RunConfig(steps=5, device=device, dtype=dtype, prefetch=prefetch)
        )
        out[label] = {
            "step_seconds": step,
            "ratio_to_bound": step / bound,
            "expected_seconds": streaming_step_seconds(
                compute, transfer, cpu, compute, forward, norm is not None
            ),
        }
    return out


def _ranks_run(
    spec: ModelSpec, train: planner.TrainSpec, ranks: int, steps: int, device: str
) -> dict[str, Any]:
    """``steps`` steps of ``headroom train`` as ``ranks`` data-parallel ranks of this node
    (``torchrun --standalone``); the report rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        model_file, train_file = Path(tmp) / "model.json", Path(tmp) / "train.json"
        report = Path(tmp) / "report.json"
        model_file.write_text(spec.model_dump_json())
        train_file.write_text(train.model_dump_json())
        dtype = "bfloat16" if device == "cuda" else "float32"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += [f"--nproc-per-node={ranks}", "-m", "headroom", "train", str(model_file)]
        argv += ["--train", str(train_file), "--steps", str(steps), "--device", device]
        argv += ["--dtype", dtype, "--report", str(report)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-2000:]}")
        out: dict[str, Any] = json.loads(report.read_text())
        return out


def ranks_vs_bound(
    layers: int,
    hidden: int,
    seq: int,
    world_sizes: list[int],
    link_rows: list[dict[str, Any]],
    adam_rate: float,
    host: int,
    device: str = "cuda",
    vocab: int = 32000,
    steps: int = 6,
) -> dict[str, Any]:
    """The ``ranks`` section (on a CPU with gloo, for tests: nothing there is a measurement)."""
    spec = scaled(layers, hidden, vocab)
    n = planner.count_params(spec).total
    h2d, d2h = bandwidth(link_rows)
    out: dict[str, Any] = {"model": spec.name, "params": n, "seq_len": seq, "runs": {}}
    one: float | None = None
    # one node holding every rank: they share its host RAM (``ranks_sharing``)
    node = planner.gpu("H200-141GB").model_copy(update={"gpus_per_node": max(world_sizes)})
    for ranks in world_sizes:
        train = planner.TrainSpec(
            micro_batch_size=1,
            seq_len=seq,
            offload={"mode": "streaming", "checkpoint_every": 1},
            parallel={"dp": ranks},
            # the precision the trainer keeps: bf16 working weights on a GPU, fp32 on a CPU
            precision={} if device == "cuda" else FP32,
        )
        budget = planner.estimate(spec, train, node)
        if budget.host_peak_bytes > 0.8 * host:
            out["runs"][ranks] = {"skipped": f"host RAM: over 80 % of {host / GiB:.0f} GiB"}
            continue
        report = _ranks_run(spec, train, ranks, steps, device)
        placement = report["placement"]
        pinned = placement.get("host_state_bytes_per_rank") or [placement["host_state_bytes"]]
        step = ranks * seq * train.grad_accum_steps / report["tokens_per_second"]
        one = one or step
        transfer = max(2 * 2 * n / (h2d * 1e9), 2 * n / (d2h * 1e9))
        out["runs"][ranks] = {
            "step_seconds": step,  # the run's mean, its first steps included
            "scaling": one / step,  # 1.0: N ranks step as fast as one (N times the tokens)
            "bound_without_compute": max(transfer, n / adam_rate / ranks),
            "host_pinned_bytes": sum(pinned),
            "planner_host_bytes": budget.host_peak_bytes,
            "host_ratio": sum(pinned) / budget.host_peak_bytes,
            "ranks_sharing": budget.host.ranks_sharing,
        }
    return out


def _trains(
    spec: ModelSpec, offload: dict[str, Any], cap_bytes: int, seq: int, device: str = "cuda"
) -> bool:
    """Two steps of ``headroom train`` in its own process under the cap: exit 0 or 3 (OOM).
    (On a CPU the cap is the simulated one; that is for tests.)"""
    with tempfile.TemporaryDirectory() as tmp:
        model_file, train_file = Path(tmp) / "model.json", Path(tmp) / "train.json"
        model_file.write_text(spec.model_dump_json())
        train_file.write_text(
            json.dumps({"micro_batch_size": 1, "seq_len": seq, "offload": offload})
        )
        argv = [sys.executable, "-m", "headroom", "train", str(model_file), "--train"]
        argv += [str(train_file), "--steps", "2", "--device", device, "--dtype", "bfloat16"]
        argv += ["--memory-cap", str(cap_bytes)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"headroom train exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.returncode == 0


def capacity(
    fraction: float,
    hidden: int,
    seq: int,
    ratio: float,
    host: int,
    device: str = "cuda",
    total: int | None = None,
    vocab: int = 32000,
) -> dict[str, Any]:
    total = total or torch.cuda.get_device_properties(0).total_memory
    cap = int(fraction * total)
    resident = {"mode": "none"}

    def trains(layers: int, offload: dict[str, Any]) -> bool:
        return _trains(scaled(layers, hidden, vocab), offload, cap, seq, device)

    lo, hi = 0, 1
    while trains(hi, resident):  # grow until it does not fit
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the largest depth that fits lies in [lo, hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trains(mid, resident) else (lo, mid)
    out: dict[str, Any] = {"cap_bytes": cap, "memory_fraction": fraction, "hidden": hidden}
    out["reference_layers"] = lo
    out["reference_oom_layers"] = hi
    if not lo:
        out["skipped"] = "the resident trainer fits no depth under this cap"
        return out
    out["reference_params"] = planner.count_params(scaled(lo, hidden, vocab)).total
    layers = hi
    while (
        planner.count_params(scaled(layers, hidden, vocab)).total < ratio * out["reference_params"]
    ):
        layers += 1
    spec = scaled(layers, hidden, vocab)
    stream = {"mode": "streaming", "checkpoint_every": 1}
    plan = planner.TrainSpec(micro_batch_size=1, seq_len=seq, offload=stream)
    out["streaming_layers"] = layers
    out["streaming_params"] = planner.count_params(spec).total
    if not host_fits(spec, plan, host):
        out["skipped"] = (
            f"host RAM: the streaming plan needs more than 80 % of {host / GiB:.0f} GiB"
        )
        return out
    out["streaming_trained"] = trains(layers, stream)
    out["ratio"] = out["streaming_params"] / out["reference_params"]
    return out


def _save(path: Path, results: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--json", type=Path, default=Path("runtime-gpu.json"))
    parser.add_argument("--ratio", type=float, default=4.5, help="capacity: streaming/reference")
    parser.add_argument(
        "--host-gib",
        type=float,
        default=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
        help="host RAM to plan streaming runs against (default: this machine's)",
    )
    args = parser.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown {unknown}; allowed: {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/runtime_gpu.py needs a CUDA GPU; this machine has none")
    host = int(args.host_gib * GiB)
    results: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    results["host_gib"] = args.host_gib
    quick = args.quick
    for section in only:
        start = time.perf_counter()
        if section == "link":
            sizes = [1, 16, 256] if quick else [1, 4, 16, 64, 256, 1024]
            results["link"] = link(sizes)
        elif section == "adam":
            numel = 16 * MiB if quick else 256 * MiB
            results["cpu_adam_params_per_s"] = cpu_adam(numel)
            results["cpu_adam_bf16_working_params_per_s"] = cpu_adam(numel, torch.bfloat16)
            results["landing"] = landing(numel // 4)
        elif section == "routing":
            # DeepSeek-V3's routed slots at 4096 tokens (256 experts, top-8, capacity 1.25)
            shape = (64, 160, 2048) if quick else (256, 160, 7168)
            results["routing"] = routing_scale(*shape)
        elif section == "steps":
            link_rows = results.get("link") or link([256])
            # the bound's CPU time: the update as the trainer runs it, bf16 working copy included
            rate = results.get("cpu_adam_bf16_working_params_per_s") or cpu_adam(
                64 * MiB, torch.bfloat16
            )
            layers, hidden, seq = (8, 2048, 1024) if quick else (16, 4096, 4096)
            results["steps"] = steps_vs_bound(layers, hidden, seq, link_rows, rate, host)
        elif section == "ranks":
            link_rows = results.get("link") or link([256])
            rate = results.get("cpu_adam_bf16_working_params_per_s") or cpu_adam(
                64 * MiB, torch.bfloat16
            )
            gpus = torch.cuda.device_count()
            sizes = [n for n in (1, 2, 4, 8) if n <= gpus]
            layers, hidden, seq = (8, 2048, 1024) if quick else (16, 4096, 4096)
            results["ranks"] = ranks_vs_bound(layers, hidden, seq, sizes, link_rows, rate, host)
        elif section == "capacity":
            fraction, hidden = (0.05, 1024) if quick else (0.1, 4096)
            results["capacity"] = capacity(fraction, hidden, 1024, args.ratio, host)
        results.setdefault("seconds", {})[section] = round(time.perf_counter() - start, 1)
        _save(args.json, results)
        print(
            f"{section}: {json.dumps(results.get(section, results.get('cpu_adam_params_per_s')))}"
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
