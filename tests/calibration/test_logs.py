"""GPU runs' own logs read back as measurements (``calibration.logs``, ``calibration.snapshot``)
and stored as calibration records (``headroom calibrate ingest``).

Each format's lines are written here by the framework's own format code, copied with its
source and commit, so that a reader that drifts from what the framework prints fails."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from headroom.calibration import snapshot
from headroom.calibration.logs import GIB, MIB, LogError, detect, read_log
from headroom.store import all_calibrations, open_store

MB = 1024.0 * 1024.0


def megatron_line(rank: int, iteration: int, peaks: tuple[int, int, int, int]) -> str:
    """NVIDIA/Megatron-LM ``megatron/training/utils/common_utils.py`` at d98e8a64,
    ``report_memory``, called as ``report_memory(f'(after {iteration} iterations)')`` by
    ``training_log`` (``megatron/training/training.py``)."""
    allocated, max_allocated, reserved, max_reserved = peaks
    name = f"(after {iteration} iterations)"
    string = name + " memory (MB)"
    string += f" | allocated: {allocated / MB:.2f}"
    string += f" | max allocated: {max_allocated / MB:.2f}"
    string += f" | reserved: {reserved / MB:.2f}"
    string += f" | max reserved: {max_reserved / MB:.2f}"
    return f"[Rank {rank}] {string}"


def megatron_line_2023(iteration: int, peaks: tuple[int, int, int, int]) -> str:
    """``megatron/utils.py`` at dc7fa885: the same without ``:.2f``."""
    allocated, max_allocated, reserved, max_reserved = peaks
    string = f"(after {iteration} iterations)" + " memory (MB)"
    string += " | allocated: {}".format(allocated / MB)  # noqa: UP032 (verbatim)
    string += " | max allocated: {}".format(max_allocated / MB)  # noqa: UP032 (verbatim)
    string += " | reserved: {}".format(reserved / MB)  # noqa: UP032 (verbatim)
    string += " | max reserved: {}".format(max_reserved / MB)  # noqa: UP032 (verbatim)
    return "[Rank {}] {}".format(0, string)  # noqa: UP032 (verbatim)


def torchtitan_line(step: int, max_reserved: int, capacity: int) -> str:
    """pytorch/torchtitan ``torchtitan/components/metrics.py`` at b5bcd76c,
    ``MetricsProcessor.log`` (``color`` is ``Color``: ANSI codes in a terminal), behind the
    ``[rank0]:`` prefix torchrun's ``--local-ranks-filter`` adds and torchtitan's logger format."""
    red, green, orange, turquoise = (
        "\033[31m",
        "\033[32m",
        "\033[38;2;180;60;0m",
        ("\033[38;2;54;234;195m"),
    )
    blue, cyan, magenta, reset = "\033[34m", "\033[36m", "\033[35m", "\033[39m"
    gib = max_reserved / (1024 * 1024 * 1024)
    pct = 100 * max_reserved / capacity
    global_avg_loss, grad_norm, tps, tflops, mfu_str = 3.24405, 0.8319, 7282, 0.52, "0.17%"
    message = (
        f"{red}step: {step:2}  "
        f"{green}loss: {global_avg_loss:8.5f}  "
        f"{orange}grad_norm: {grad_norm:7.4f}  "
        f"{turquoise}memory: {gib:5.2f}GiB"
        f"({pct:.2f}%)  "
        f"{blue}tps: {round(tps):,}  "  # noqa: RUF057 (verbatim)
        f"{cyan}tflops: {tflops:,.2f}  "
        f"{magenta}mfu: {mfu_str}{reset}"
    )
    return f"[rank0]:[titan] 2026-05-18 16:04:46,338 - root - INFO - {message}"


def deepspeed_lines(message: str, allocated: int, max_allocated: int, reserved: int) -> list[str]:
    """microsoft/DeepSpeed ``deepspeed/runtime/utils.py`` at 38327e07, ``see_memory_usage``
    (its backslash continuations keep the next line's indent inside the f-string), behind
    DeepSpeed's logger format ``[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:
    %(funcName)s] %(message)s``."""
    g = 1024 * 1024 * 1024
    prefix = "[2025-02-07 01:13:40,037] [INFO] [utils.py:{}:see_memory_usage] "
    line = f"MA {round(allocated / g, 2)} GB \
        Max_MA {round(max_allocated / g, 2)} GB \
        CA {round(reserved / g, 2)} GB \
        Max_CA {round(reserved / g)} GB "
    return [
        prefix.format(781) + message,
        prefix.format(782) + line,
        prefix.format(789) + "CPU Virtual Memory:  used = 8.07 GB, percent = 25.8%",
    ]


def hf_metrics_block(split: str, metrics: dict[str, Any]) -> list[str]:
    """huggingface/transformers ``trainer_pt_utils.py`` at 5ea83b0e: ``metrics_format`` (memory
    values ``f"{ v >> 20 }MB"``) and ``log_metrics``."""
    formatted = {
        k: (f"{v >> 20}MB" if "_mem_" in k else round(v, 4) if isinstance(v, float) else v)
        for k, v in metrics.items()
    }
    k_width = max(len(str(x)) for x in formatted)
    v_width = max(len(str(x)) for x in formatted.values())
    lines = [f"***** {split} metrics *****"]
    for key in sorted(formatted):
        lines.append(f"  {key: <{k_width}} = {formatted[key]:>{v_width}}")
    return lines


def hf_tracker(before: int, init: tuple[int, int], train: tuple[int, int]) -> dict[str, Any]:
    """The metrics ``TrainerMemoryTracker.update_metrics`` adds (transformers
    ``trainer_utils.py`` at c599e989): per stage ``alloc`` = end - begin and ``peaked`` =
    max(0, peak - end), with ``before_init_mem_gpu`` the first stage's begin."""
    return {
        "before_init_mem_gpu": before,
        "init_mem_gpu_alloc_delta": init[0],
        "init_mem_gpu_peaked_delta": init[1],
        "train_mem_gpu_alloc_delta": train[0],
        "train_mem_gpu_peaked_delta": train[1],
        "train_loss": 1.2346,
        "epoch": 3.0,
    }


def accelerate_lines(begin: int, used: int, peaked: int) -> list[str]:
    """huggingface/accelerate ``examples/by_feature/fsdp_with_peak_mem_tracking.py`` at
    16cb6eb8 (``b2mb(x) = int(x / 2**20)``)."""

    def b2mb(x: int) -> int:
        return int(x / 2**20)

    return [
        f"Memory before entering the train : {b2mb(begin)}",
        f"Memory consumed at the end of the train (end-begin): {b2mb(used)}",
        f"Peak Memory consumed during the train (max-begin): {b2mb(peaked)}",
        f"Total Peak Memory consumed during the train (max): {b2mb(peaked) + b2mb(begin)}",
    ]


def text(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# --- each format, as its framework prints it --------------------------------------------------


def test_megatron_report_memory_gives_the_largest_rank_and_iteration() -> None:
    lines = [
        " > building GPT model ...",
        megatron_line(0, 1, (3 * GIB, 5 * GIB, 6 * GIB, 6 * GIB)),
        megatron_line(3, 1, (3 * GIB, 7 * GIB + 123 * MIB, 8 * GIB, 9 * GIB)),
        " iteration        2/     100 | consumed samples: 64 | elapsed time per iteration",
        megatron_line(0, 2, (3 * GIB, 5 * GIB + 10 * MIB, 6 * GIB, 6 * GIB)),
    ]
    data = text(lines)
    assert detect(data, "train.log") == "megatron"
    reading = read_log(data, "train.log")
    measured = reading.measurement()
    # MiB to two decimals: within 0.005 MiB of the statistic
    assert measured.allocated_bytes == pytest.approx(7 * GIB + 123 * MIB, abs=MIB / 100)
    assert measured.reserved_bytes == pytest.approx(9 * GIB, abs=MIB / 100)
    assert measured.figure == "max_allocated"
    assert [(s.rank, s.step) for s in reading.steps] == [(0, 1), (3, 1), (0, 2)]
    assert reading.steps[0].label == "after 1 iterations"


def test_megatron_report_memory_of_2023_prints_whole_floats() -> None:
    data = text([megatron_line_2023(100, (2 * GIB, 10 * GIB + 1, 12 * GIB, 12 * GIB))])
    measured = read_log(data, "old.log").measurement()
    assert measured.allocated_bytes == 10 * GIB + 1
    assert measured.reserved_bytes == 12 * GIB


def test_torchtitan_memory_is_the_reserved_peak_of_every_log_step() -> None:
    capacity = 80 * GIB
    lines = [
        "[rank0]:[titan] 2026-05-18 16:04:40,000 - root - INFO - Training starts at step 1",
        torchtitan_line(1, 33 * GIB + 210 * MIB, capacity),
        torchtitan_line(10, 44 * GIB + 860 * MIB, capacity),
        torchtitan_line(20, 44 * GIB + 850 * MIB, capacity),
    ]
    data = text(lines)
    assert detect(data, "titan.log") == "torchtitan"
    reading = read_log(data, "titan.log")
    measured = reading.measurement()
    assert measured.allocated_bytes is None and measured.figure == "max_reserved"
    # GiB to two decimals: within 0.005 GiB
    assert measured.reserved_bytes == pytest.approx(44 * GIB + 860 * MIB, abs=GIB / 200)
    assert [s.step for s in reading.steps] == [1, 10, 20]
    assert {s.rank for s in reading.steps} == {0}


def test_deepspeed_see_memory_usage_keeps_the_allocated_peak_only() -> None:
    lines = [
        *deepspeed_lines("After creating fp32 partitions", 2 * GIB, 3 * GIB, 4 * GIB),
        *deepspeed_lines("before backward 1", 5 * GIB, 5 * GIB + 330 * MIB, 7 * GIB),
    ]
    data = text(lines)
    assert detect(data, "ds.log") == "deepspeed"
    reading = read_log(data, "ds.log")
    measured = reading.measurement()
    assert measured.allocated_bytes == pytest.approx(5 * GIB + 330 * MIB, abs=GIB / 200)
    # Max_CA is a whole GiB: too coarse to keep as the reserved peak
    assert measured.reserved_bytes is None
    assert [s.label for s in reading.steps] == [
        "After creating fp32 partitions",
        "before backward 1",
    ]


def test_hf_trainer_metrics_printed_and_saved_give_each_stage_its_peak() -> None:
    metrics = hf_tracker(0, (13 * GIB, 0), (-153 * MIB, 2012 * MIB))
    printed = text(["{'train_runtime': 12.34}", *hf_metrics_block("train", metrics), "done"])
    assert detect(printed, "stdout") == "hf_trainer"
    reading = read_log(printed, "stdout")
    # the train stage starts where init ended (13 GiB) and peaks 2012 MiB above its end
    assert [(s.label, s.allocated_bytes) for s in reading.steps] == [
        ("init", 13 * GIB),
        ("train", 13 * GIB - 153 * MIB + 2012 * MIB),
    ]
    saved = json.dumps(metrics, indent=4, sort_keys=True).encode()  # save_metrics
    assert detect(saved, "all_results.json") == "hf_trainer"
    assert read_log(saved, "all_results.json").measurement() == reading.measurement().model_copy(
        update={"steps": read_log(saved, "x").steps}
    )


def test_accelerate_total_peak_lines() -> None:
    data = text(accelerate_lines(begin=6 * GIB, used=GIB, peaked=9 * GIB))
    assert detect(data, "acc.log") == "accelerate"
    assert read_log(data, "acc.log").measurement().allocated_bytes == 15 * GIB


@pytest.mark.parametrize("units", [True, False], ids=["csv", "csv,nounits"])
def test_nvidia_smi_csv_gives_the_largest_sample_of_any_gpu(units: bool) -> None:
    unit = " MiB" if units else ""
    lines = [
        "timestamp, index, name, memory.used [MiB], memory.total [MiB]",
        f"2024/05/01 12:00:00.123, 0, NVIDIA H100 80GB HBM3, 12345{unit}, 81559{unit}",
        f"2024/05/01 12:00:01.123, 1, NVIDIA H100 80GB HBM3, 70001{unit}, 81559{unit}",
        f"2024/05/01 12:00:02.123, 0, NVIDIA H100 80GB HBM3, 69000{unit}, 81559{unit}",
    ]
    data = text(lines)
    assert detect(data, "smi.csv") == "nvidia_smi"
    measured = read_log(data, "smi.csv").measurement()
    assert measured.figure == "nvidia_smi_total" and measured.nvidia_smi_bytes == 70001 * MIB


# --- refusals: one line naming the line --------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        ([megatron_line(0, 1, (GIB, GIB, GIB, GIB))[:-12]], "m.log:1:"),
        (["x", torchtitan_line(1, GIB, 80 * GIB).split("memory:")[0] + "memory: 4"], "m.log:2:"),
        ([deepspeed_lines("m", GIB, GIB, GIB)[1][:-8]], "m.log:1:"),
        (
            [*accelerate_lines(GIB, GIB, GIB)[:3], "Total Peak Memory consumed during the train"],
            "m.log:4:",
        ),
        (
            [
                "timestamp, index, memory.used [MiB]",
                "2024/05/01 12:00:00.123, 0, 123 MiB",
                "2024/05",
            ],
            "m.log:3:",
        ),
    ],
    ids=["megatron", "torchtitan", "deepspeed", "accelerate", "nvidia_smi"],
)
def test_a_log_cut_short_is_refused_naming_its_line(lines: list[str], where: str) -> None:
    with pytest.raises(LogError) as caught:
        read_log(text(lines), "m.log")
    assert str(caught.value).startswith(where), caught.value


def test_a_log_without_memory_lines_names_the_formats() -> None:
    with pytest.raises(LogError, match=r"no memory line of a known format .*megatron"):
        read_log(b"step 1 loss 3.2\nstep 2 loss 3.1\n", "plain.log")
    with pytest.raises(LogError, match="no torchtitan memory line"):
        read_log(b"nothing here\n", "plain.log", "torchtitan")
    with pytest.raises(LogError, match=r"format: unknown 'tensorboard'; allowed: megatron"):
        read_log(b"x", "plain.log", "tensorboard")


# --- a memory snapshot ------------------------------------------------------------------------


def frames(*names: tuple[str, str]) -> list[dict[str, Any]]:
    """A snapshot's frames, innermost first, as ``THCPModule_memorySnapshot`` writes them."""
    return [{"filename": f, "line": 1, "name": n} for f, n in names]


FORWARD = frames(("/x/torch/nn/functional.py", "linear"), ("/x/model.py", "forward"))
BACKWARD = frames(
    ("/x/torch/autograd/graph.py", "_engine_run_backward"), ("/x/torch/_tensor.py", "backward")
)
OPTIMIZER = frames(
    ("/x/torch/optim/adam.py", "_multi_tensor_adam"), ("/x/torch/optim/adam.py", "step")
)
SETUP = frames(("/x/torch/nn/modules/module.py", "_apply"), ("/x/train.py", "main"))


def entry(
    action: str, addr: int, size: int, where: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    e: dict[str, Any] = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0}
    if where is not None:
        e["frames"] = where
    return e


def a_snapshot() -> dict[str, Any]:
    """The documented schema (``torch/cuda/memory.py``'s ``_snapshot`` docstring, with the keys
    the C++ adds): weights, a forward, a backward that frees it, an optimizer step with a
    temporary, and a second forward whose activations outgrow the first."""
    w, s, t = 100 * MIB, 40 * MIB, 30 * MIB
    trace = [
        entry("segment_alloc", 0x1000, 256 * MIB, SETUP),
        entry("alloc", 1, w, SETUP),  # the weights
        entry("alloc", 2, 50 * MIB, FORWARD),  # step 1's activations
        entry("alloc", 3, w, BACKWARD),  # gradients: kept past the backward
        entry("alloc", 7, 20 * MIB, BACKWARD),  # an activation gradient: freed within it
        entry("free_completed", 7, 20 * MIB, BACKWARD),
        entry("free_requested", 2, 50 * MIB, BACKWARD),
        entry("free_completed", 2, 50 * MIB, BACKWARD),
        entry("alloc", 4, s, OPTIMIZER),  # optimizer state
        entry("alloc", 5, t, OPTIMIZER),  # a step temporary
        entry("free_completed", 5, t, OPTIMIZER),
        entry("segment_alloc", 0x9000, 128 * MIB, FORWARD),
        entry("alloc", 6, 80 * MIB, FORWARD),  # step 2's activations: the run's peak
        entry("free_completed", 6, 80 * MIB, BACKWARD),
    ]
    blocks = [
        {
            "address": 0x1000,
            "size": w,
            "requested_size": w,
            "state": "active_allocated",
            "frames": [],
        },
        {
            "address": 0x2000,
            "size": w,
            "requested_size": w,
            "state": "active_allocated",
            "frames": [],
        },
        {
            "address": 0x3000,
            "size": s,
            "requested_size": s,
            "state": "active_allocated",
            "frames": [],
        },
        {
            "address": 0x4000,
            "size": 16 * MIB,
            "requested_size": 16 * MIB,
            "state": "inactive",
            "frames": [],
        },
    ]
    segments = [
        {
            "device": 0,
            "address": 0x1000,
            "total_size": 256 * MIB,
            "allocated_size": 240 * MIB,
            "active_size": 240 * MIB,
            "requested_size": 240 * MIB,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        },
        {
            "device": 0,
            "address": 0x9000,
            "total_size": 128 * MIB,
            "allocated_size": 0,
            "active_size": 0,
            "requested_size": 0,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": [],
        },
    ]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {}}


def test_a_memory_snapshot_replays_its_peak_phases_and_buckets() -> None:
    data = pickle.dumps(a_snapshot())
    assert detect(data, "snap.pickle") == "memory_snapshot"
    reading = read_log(data, "snap.pickle")
    measured = reading.measurement()
    # weights + grads + state + step 2's activations
    assert measured.allocated_bytes == (100 + 100 + 40 + 80) * MIB
    assert measured.reserved_bytes == 384 * MIB
    assert measured.phase == "forward"  # step 2's: no longer the first step's
    # the backward's by their lifetime: the gradients it keeps, not the one it freed
    assert measured.buckets == {
        "params": 100 * MIB,
        "grads": 100 * MIB,
        "activations": 80 * MIB,
        "optimizer_states": 40 * MIB,
    }
    phases = [(s.step, s.label, s.allocated_bytes) for s in reading.steps if s.step]
    assert phases == [
        (1, "forward", 150 * MIB),
        (1, "backward", 270 * MIB),
        (1, "optimizer", 270 * MIB),
        (2, "forward", 320 * MIB),  # a phase starts with its first allocation, not a free
    ]


def test_a_snapshot_whose_history_began_mid_run_counts_what_was_there() -> None:
    snap = a_snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][6:]  # the ring buffer lost the start
    measured = read_log(pickle.dumps(snap), "late.pickle").measurement()
    assert measured.allocated_bytes == 320 * MIB


def test_a_snapshot_pickle_naming_a_callable_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    data = pickle.dumps({"segments": [], "device_traces": [[Evil()]]})
    with pytest.raises(LogError, match="plain data only; this pickle names pathlib"):
        read_log(data, "evil.pickle")
    assert not marker.exists()
    with pytest.raises(LogError, match="not a whole memory snapshot pickle"):
        read_log(pickle.dumps(a_snapshot())[:-40], "cut.pickle")


def test_frames_name_the_phase() -> None:
    assert snapshot.phase_of(FORWARD) == "forward"
    assert snapshot.phase_of(BACKWARD) == "backward"
    assert snapshot.phase_of(OPTIMIZER) == "optimizer"
    assert snapshot.phase_of(SETUP) is None
    # an optimizer step called inside a module's forward is still the optimizer's
    assert snapshot.phase_of(OPTIMIZER + FORWARD) == "optimizer"


# --- headroom calibrate ingest ----------------------------------------------------------------


TITAN = [
    "--model",
    "llama-3-8b",
    "--set",
    "framework=fsdp2",
    "--set",
    "parallel.dp=8",
    "--set",
    "parallel.zero_stage=3",
    "--set",
    "activation_profile=torchtitan",
    "--set",
    "recompute=selective_op",
    "--set",
    "seq_len=8192",
]


def test_ingest_stores_a_record_of_the_stack_once_and_names_its_trust(
    cli: Any, tmp_path: Path
) -> None:
    log = tmp_path / "titan.log"
    log.write_bytes(text([torchtitan_line(s, (40 + s) * GIB, 80 * GIB) for s in (1, 5)]))
    first = cli("calibrate", "ingest", str(log), *TITAN, "--output", "json")
    assert first.exit_code == 0, first.output
    out = json.loads(first.stdout)
    (record,) = out["records"]
    assert record["created"] and record["format"] == "torchtitan"
    assert (record["framework"], record["activation_profile"], record["gpu"]) == (
        "fsdp2",
        "torchtitan",
        "H100-80GB",
    )
    assert record["figure"] == "max_reserved"
    assert record["measured_bytes"] == 45 * GIB
    (trust,) = out["trust"]
    assert trust["recent_records"] == 1 and trust["trusted"] is False
    again = json.loads(cli("calibrate", "ingest", str(log), *TITAN, "--output", "json").stdout)
    assert not again["records"][0]["created"]
    assert again["records"][0]["uid"] == record["uid"]
    text_out = cli("calibrate", "ingest", str(log), *TITAN)
    said = "trust: calibrated on 1 run(s) of fsdp2/torchtitan on H100-80GB: untrusted, margin"
    assert said in text_out.stdout


def test_ingest_refuses_every_log_when_one_is_bad_and_stores_nothing(
    cli: Any, tmp_path: Path
) -> None:
    good = tmp_path / "good.log"
    good.write_bytes(text([torchtitan_line(1, 40 * GIB, 80 * GIB)]))
    bad = tmp_path / "bad.log"
    cut = megatron_line(0, 1, (GIB, GIB, GIB, GIB)).split("| max reserved")[0]
    bad.write_bytes(text(["x", "y", cut]))
    result = cli("calibrate", "ingest", str(good), str(bad), *TITAN)
    assert result.exit_code == 2
    assert f"{bad}:3: a Megatron report_memory line cut short" in result.output
    with open_store()() as session:
        assert all_calibrations(session=session) == []
    no_model = cli("calibrate", "ingest", str(good))
    assert no_model.exit_code == 2 and "--model" in no_model.output


def test_published_runs_become_records_with_their_own_errors(cli: Any) -> None:
    from headroom.calibration import published

    path = Path(published.__file__).parent / "data" / "published-memory.json"
    result = cli("calibrate", "ingest", str(path), "--output", "json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    replayed = {r.id: r for r in map(published.replay, published.runs())}
    numbered = [r for r in replayed.values() if r.error_pct is not None]
    assert len(out["records"]) == len(numbered) and len(out["skipped"]) == len(replayed) - len(
        numbered
    )
    for record in out["records"]:
        # like with like, on the stage whose rank logged: the published table's own error
        assert record["relative_error"] * 100 == pytest.approx(
            replayed[record["name"]].error_pct, abs=0.05
        ), record["name"]
    stacks = {(t["gpu"], t["framework"], t["activation_profile"]) for t in out["trust"]}
    assert ("H100-80GB", "fsdp2", "torchtitan") in stacks
    # calibrate report shows every stack's trust from the records, as estimate --calibrated
    report = json.loads(cli("calibrate", "report", "--format", "json").stdout)
    trust = {(t["gpu"], t["framework"], t["activation_profile"]): t for t in report["trust"]}
    titan = trust["H100-80GB", "fsdp2", "torchtitan"]
    on_it = [
        r
        for r in out["records"]
        if (r["gpu"], r["framework"], r["activation_profile"])
        == ("H100-80GB", "fsdp2", "torchtitan")
    ]
    assert titan["recent_records"] == len(on_it)
    worst = min(r["relative_error"] for r in on_it)
    assert titan["observed_error"] == pytest.approx(worst, abs=1e-6)
    assert not titan["trusted"] and titan["margin_fraction"] == pytest.approx(
        math.ceil((-worst + 0.05) * 100 - 1e-9) / 100
    )
    text_report = cli("calibrate", "report")
    assert (
        f"calibrated on {len(on_it)} run(s) of fsdp2/torchtitan on H100-80GB" in text_report.stdout
    )


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            pickle.dumps({"segments": [{"total_size": 10, "blocks": [5]}], "device_traces": [[]]}),
            "not a memory snapshot as torch writes it",
        ),
        (
            pickle.dumps(
                {
                    "segments": [],
                    "device_traces": [[{"action": "alloc", "addr": 1, "size": 5, "frames": [3]}]],
                }
            ),
            "not a memory snapshot as torch writes it",
        ),
        (
            text([megatron_line(0, 1, (GIB, 2**60, GIB, GIB))]),
            "a figure a measurement cannot hold",
        ),
    ],
    ids=["snapshot-block", "snapshot-frame", "past-a-pebibyte"],
)
def test_a_log_of_another_shape_is_refused_naming_it(data: bytes, says: str) -> None:
    with pytest.raises(LogError, match=says):
        read_log(data, "odd.log")


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"runs": [5], "figure": 1}', "runs[0]: not a published run"),
        (
            b'{"runs": [{"figure": "max_allocated", "measured_gib": "x"}]}',
            "runs[0]: not a published run",
        ),
        (b'{"runs": 3, "figure": 1}', "not the published runs' file"),
    ],
    ids=["run-not-an-object", "figure-not-a-number", "runs-not-a-list"],
)
def test_a_published_file_of_another_shape_is_refused_naming_the_run(
    content: bytes, says: str
) -> None:
    from headroom.calibration.ingest import read_logs

    with pytest.raises(LogError, match=re.escape(says)):
        read_logs([("p.json", content)], fmt="published")
