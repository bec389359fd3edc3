"""The trainer's report as one typed model: the JSON the trainer writes reads back into it and
dumps to the same keys, and what readers derive from it (steps, the measured peak) is typed."""

from __future__ import annotations

from pathlib import Path

from headroom import planner
from headroom.planner.report import TrainerReport, read_report

CPU_CAPPED = {
    "model": "tiny-dense",
    "train": planner.TrainSpec(seq_len=16).model_dump(mode="json"),
    "device": "cpu",
    "dtype": "float32",
    "seed": 0,
    "memory_cap_bytes": 1 << 20,
    "oom": {"phase": "forward", "step": 1, "after": "placement", "message": "cap"},
    "memory": {
        "available": False,
        "reason": "device cpu: allocator counters exist only on CUDA; none are reported",
        "simulated": {
            "cap_bytes": 1 << 20,
            "allocated_peak_bytes": 900_000,
            "failed_request": {"requested_bytes": 300_000, "live_bytes": 800_000},
            "phases": [
                {
                    "phase": "placement",
                    "step": 0,
                    "allocated_bytes": 500_000,
                    "allocated_peak_bytes": 600_000,
                }
            ],
        },
    },
}

CUDA_DONE = {
    "model": "tiny-dense",
    "losses": [2.5, 2.25],
    "steps": 2,
    "memory": {
        "available": True,
        "device": "NVIDIA H100",
        "allocator_config": "",
        "allocated_peak_bytes": 4000,
        "reserved_peak_bytes": 5000,
        "phases": [
            {
                "phase": "forward",
                "step": 1,
                "allocated_bytes": 3000,
                "allocated_peak_bytes": 4000,
                "reserved_bytes": 5000,
                "reserved_peak_bytes": 5000,
                "device_free_bytes": 10,
                "device_total_bytes": 6000,
            }
        ],
    },
}


def test_a_report_reads_back_and_dumps_to_the_same_keys() -> None:
    for written in (CPU_CAPPED, CUDA_DONE):
        assert TrainerReport.model_validate(written).dump() == written


def test_what_readers_derive_is_typed() -> None:
    oom = TrainerReport.model_validate(CPU_CAPPED)
    assert oom.completed_steps == 0 and oom.oom is not None and oom.oom.phase == "forward"
    assert oom.memory is not None
    assert oom.memory.measured_peak_bytes == 1_100_000  # held plus what it asked for
    assert [p.phase for p in oom.memory.measured_phases] == ["placement"]
    done = TrainerReport.model_validate(CUDA_DONE)
    assert done.completed_steps == 2 and done.oom is None
    assert done.memory is not None and done.memory.measured_peak_bytes == 4000


def test_a_missing_or_broken_report_reads_as_empty(tmp_path: Path) -> None:
    assert read_report(tmp_path / "none.json") == TrainerReport()
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert read_report(tmp_path / "bad.json") == TrainerReport()
