"""Probe snapshots attributed to what holds the bytes: a real (CPU, simulated-cap) run and the
CUDA fields' arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration.attribution import attribute
from headroom.planner.report import PhaseSnapshot, read_report
from headroom.runtime.model import DecoderLM


def test_a_probed_run_attributes_resident_and_optimizer_state_to_the_byte(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    proc = run_headroom(
        "train",
        "tiny-dense",
        "--steps",
        "2",
        "--dtype",
        "float32",  # the spec's bf16 otherwise: the byte counts below are fp32's
        "--set",
        "seq_len=64",
        "--memory-cap",
        "1GiB",
        "--report",
        str(report),
    )
    assert proc.returncode == 0, proc.stderr
    memory = read_report(report).memory
    assert memory is not None and memory.simulated is not None
    out = attribute(memory.simulated.phases)
    model = planner.load_model("tiny-dense")
    n = planner.count_params(model).total
    with torch.device("meta"):
        tensors = len(list(DecoderLM(model, 1.25).parameters()))
    assert out["resident_bytes"] == 4 * n  # fp32 on the CPU
    assert out["optimizer_state_bytes"] == 8 * n + 4 * tensors  # two moments, step counters
    assert 0 < out["forward_transient_bytes"] <= out["forward_peak_bytes"]
    assert "allocator_overhead_bytes" not in out and "context_bytes" not in out


def test_cuda_snapshots_give_allocator_overhead_and_context() -> None:
    gib = 2**30

    def snap(phase: str, step: int, allocated: int, peak: int, reserved: int) -> PhaseSnapshot:
        return PhaseSnapshot(
            phase=phase,
            step=step,
            allocated_bytes=allocated * gib,
            allocated_peak_bytes=peak * gib,
            reserved_bytes=reserved * gib,
            reserved_peak_bytes=reserved * gib,
            device_total_bytes=141 * gib,
            device_free_bytes=(141 - reserved - 1) * gib,  # 1 GiB outside the allocator
        )

    phases = [
        snap("placement", 0, 10, 10, 12),
        snap("forward", 1, 40, 42, 44),
        snap("backward", 1, 20, 50, 52),
        snap("optimizer", 1, 30, 31, 52),
        snap("forward", 2, 60, 65, 70),
    ]
    assert attribute(phases) == {
        "resident_bytes": 10 * gib,
        "optimizer_state_bytes": 20 * gib,
        "forward_transient_bytes": 30 * gib,
        "forward_peak_bytes": 35 * gib,
        "allocator_overhead_bytes": 5 * gib,  # reserved peak 70 - allocated peak 65
        "context_bytes": 1 * gib,
    }
    assert attribute([]) == {}


def test_the_gpu_matrix_design_covers_the_issue_and_straddles_the_card() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import calibration_gpu
    finally:
        sys.path.pop(0)
    configs = calibration_gpu.design("H200-141GB")
    assert len(configs) >= 30
    trains = [t for _, _, t in configs]
    assert {t["offload"]["mode"] for t in trains if "offload" in t} == {
        "none",
        "optimizer",
        "streaming",
    }
    assert {str(t["recompute"]) for t in trains if "recompute" in t} >= {
        "none",
        "full",
        "selective",
    }
    assert {t["micro_batch_size"] for t in trains} >= {1, 2, 4, 8}
    assert {t["seq_len"] for t in trains} >= {512, 8192}
    assert any(m.get("moe") for _, m, _ in configs)
    hw = planner.load_hardware("H200-141GB")
    cliff = [
        planner.estimate(planner.load_model(m), planner.load_train(t), hw).fits
        for label, m, t in configs
        if label.startswith("cliff")
    ]
    assert True in cliff and False in cliff  # predictions on both sides of the capacity
