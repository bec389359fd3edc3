"""A GPU run's own log, read back as a measurement: the memory lines each stack prints.

Every format is read from the lines as the framework writes them (the source and commit are
named beside each reader) and recognised from its content (:func:`detect`):

- ``megatron``: Megatron-LM's ``report_memory``, ``[Rank R] (after N iterations) memory (MB) |
  allocated: A | max allocated: MA | reserved: R | max reserved: MR`` (NVIDIA/Megatron-LM
  ``megatron/training/utils/common_utils.py`` at d98e8a64; ``megatron/utils.py`` at dc7fa885
  printed the same without ``:.2f``). The max figures are never reset; each data-parallel rank 0
  prints its own (one per pipeline and tensor-parallel rank), so the run's peak is the largest.
- ``torchtitan``: ``step: N  loss: ...  memory: X.XXGiB(Y.YY%)`` (pytorch/torchtitan
  ``torchtitan/components/metrics.py`` at b5bcd76c; ``train.py`` at 542ca779 before it): the
  reserved peak (``reserved_bytes.all.peak``) since the previous log line, which resets it.
- ``deepspeed``: DeepSpeed's ``see_memory_usage``, ``MA a GB  Max_MA b GB  CA c GB  Max_CA d
  GB`` (microsoft/DeepSpeed ``deepspeed/runtime/utils.py`` at 38327e07): the allocated peak since
  the previous call, in GiB to two decimals. ``Max_CA`` is rounded to a whole GiB there
  (``round(x)``), too coarse for a reserved figure, so none is kept.
- ``hf_trainer``: the Trainer's memory metrics (``skip_memory_metrics=False``), printed by
  ``log_metrics`` (``  train_mem_gpu_peaked_delta =     2012MB``, MiB rounded down) or saved by
  ``save_metrics`` as ``train_results.json`` / ``all_results.json`` in bytes
  (huggingface/transformers ``trainer_utils.py`` ``TrainerMemoryTracker`` at c599e989,
  ``trainer_pt_utils.py`` at 5ea83b0e). A stage's peak is its start (``before_init_mem_gpu``
  plus the allocation deltas of the stages before it) plus its ``alloc`` and ``peaked`` deltas.
- ``accelerate``: the ``TorchTracemalloc`` lines of Accelerate's peak-memory example,
  ``Total Peak Memory consumed during the train (max): M`` in MiB (huggingface/accelerate
  ``examples/by_feature/fsdp_with_peak_mem_tracking.py`` at 16cb6eb8).
- ``nvidia_smi``: ``nvidia-smi --query-gpu=...,memory.used --format=csv`` (with or without
  ``nounits``; the header names the columns): device memory in use, the CUDA context and every
  process's reserve included. The largest sample of any GPU.
- ``memory_snapshot``: a pickle of ``torch.cuda.memory._snapshot()`` (``_dump_snapshot``): read
  by :mod:`headroom.calibration.snapshot`.

Each reader returns the figures per step (or per sample) and rank; :func:`read_log` takes their
largest as the run's peak. A line that starts like a format's memory line but does not end
like one (a log cut short, or edited) is refused naming its line; so is a log with none.
Only the standard library: nothing here imports torch.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from headroom import planner
from headroom.planner.measurement import Measurement, StepMeasurement

MIB = 2**20
GIB = 2**30
#: the per-step figures a record keeps (the first ones; the peak is over all of them)
MAX_STEPS_KEPT = 1000
#: the longest line searched for a memory figure
MAX_LINE = 16384
#: the largest log read (a longer one is refused, naming the limit)
MAX_LOG_BYTES = 256 * 2**20

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"


class LogError(planner.InputFormatError):
    """A log that cannot be read as the format it is (or is said to be)."""


@dataclass(frozen=True)
class LogReading:
    """What one log gave: its format and every figure it printed."""

    format: str
    name: str
    steps: tuple[StepMeasurement, ...]
    phase: str | None = None  # the phase of the allocated peak, where the log tells it
    buckets: dict[str, int] | None = None  # live bytes per bucket at the peak, where attributed

    def measurement(self) -> Measurement:
        """The run's peaks (the largest of each figure) with the per-step figures."""

        def peak(attr: str) -> int | None:
            values = [getattr(s, attr) for s in self.steps if getattr(s, attr) is not None]
            return max(values) if values else None

        return Measurement(
            allocated_bytes=peak("allocated_bytes"),
            reserved_bytes=peak("reserved_bytes"),
            nvidia_smi_bytes=peak("nvidia_smi_bytes"),
            steps=self.steps[:MAX_STEPS_KEPT],
            log_format=self.format,
            phase=self.phase,
            buckets=self.buckets or None,
        )


def _bytes(value: str, unit: int) -> int:
    return max(1, round(float(value) * unit))


def _text_lines(data: bytes, name: str) -> list[str]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LogError(f"{name}: not UTF-8 text (byte {exc.start}); a log is text") from None
    # no framework prints a memory line this long: longer lines are not searched (a pattern
    # tried along a megabyte-long line costs more than the whole log is worth)
    return [_ANSI.sub("", line) if len(line) <= MAX_LINE else "" for line in text.splitlines()]


def _fail(name: str, number: int, what: str) -> LogError:
    return LogError(f"{name}:{number}: {what}")


def _matches(
    lines: Sequence[str], name: str, start: re.Pattern[str], full: re.Pattern[str], like: str
) -> Iterator[tuple[str, re.Match[str], re.Match[str]]]:
    """(line, where it starts, its whole match) of each line a format's memory line starts on
    (``start``), matched whole (``full``) from there; one that starts like such a line and does
    not end like one is refused naming its line (``like``: what such a line looks like)."""
    for number, line in enumerate(lines, 1):
        begun = start.search(line)
        if begun is None:
            continue
        match = full.match(line, begun.start())
        if match is None:
            raise _fail(name, number, like)
        yield line, begun, match


# --- Megatron-LM ------------------------------------------------------------------------------

_MEGATRON_START = re.compile(r"memory \(MB\)\s*\|\s*allocated:")
_MEGATRON = re.compile(
    r"memory \(MB\)"
    rf"\s*\|\s*allocated: (?P<a>{_NUMBER})"
    rf"\s*\|\s*max allocated: (?P<ma>{_NUMBER})"
    rf"\s*\|\s*reserved: (?P<r>{_NUMBER})"
    rf"\s*\|\s*max reserved: (?P<mr>{_NUMBER})"
    rf"(?:\s*\|\s*total device memory used: (?P<dev>{_NUMBER}))?\s*$"
)
_ITERATIONS = re.compile(r"after (\d+) iterations")
_RANK = re.compile(r"\[Rank (\d+)\]")


def read_megatron(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    out = []
    like = (
        "a Megatron report_memory line cut short or altered; expected '... memory (MB) | "
        "allocated: A | max allocated: MA | reserved: R | max reserved: MR'"
    )
    for line, start, match in _matches(lines, name, _MEGATRON_START, _MEGATRON, like):
        head = line[: start.start()]
        rank = _RANK.search(head)
        label = _RANK.sub("", head).strip().strip("()").strip()
        iteration = _ITERATIONS.search(label)
        out.append(
            StepMeasurement(
                step=int(iteration.group(1)) if iteration else None,
                rank=int(rank.group(1)) if rank else None,
                label=label[:200] or None,
                allocated_bytes=_bytes(match["ma"], MIB),
                reserved_bytes=_bytes(match["mr"], MIB),
                nvidia_smi_bytes=_bytes(match["dev"], MIB) if match["dev"] else None,
            )
        )
    return out


# --- torchtitan -------------------------------------------------------------------------------

_TITAN_START = re.compile(r"\bstep:\s*\d+\s.*\bmemory:")
_TITAN = re.compile(
    rf"\bstep:\s*(?P<step>\d+)\s.*\bmemory:\s*(?P<gib>{_NUMBER})GiB\((?P<pct>{_NUMBER})%\)"
)
_TITAN_RANK = re.compile(r"\[rank(\d+)\]")


def read_torchtitan(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    out = []
    like = "a torchtitan step line without its 'memory: X.XXGiB(Y.YY%)' field (cut short?)"
    for line, _, match in _matches(lines, name, _TITAN_START, _TITAN, like):
        rank = _TITAN_RANK.search(line)
        out.append(
            StepMeasurement(
                step=int(match["step"]),
                rank=int(rank.group(1)) if rank else None,
                reserved_bytes=_bytes(match["gib"], GIB),
            )
        )
    return out


# --- DeepSpeed --------------------------------------------------------------------------------

_DS_START = re.compile(r"\bMA \S+ GB\s+Max_MA\b")
_DS = re.compile(
    rf"\bMA (?P<ma>{_NUMBER}) GB\s+Max_MA (?P<max>{_NUMBER}) GB"
    rf"\s+CA (?P<ca>{_NUMBER}) GB\s+Max_CA (?P<maxca>{_NUMBER}) GB\s*$"
)
_DS_MESSAGE = re.compile(r"\[INFO\] \[[^\]]*:see_memory_usage\] (?P<message>.*)$")


def read_deepspeed(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    out = []
    message = None
    for number, line in enumerate(lines, 1):
        if _DS_START.search(line) is None:
            said = _DS_MESSAGE.search(line)
            if said is not None and not said["message"].startswith("CPU Virtual Memory"):
                message = said["message"].strip()
            continue
        match = _DS.search(line)
        if match is None:
            raise _fail(
                name,
                number,
                "a DeepSpeed see_memory_usage line cut short or altered; expected "
                "'MA a GB  Max_MA b GB  CA c GB  Max_CA d GB'",
            )
        out.append(
            StepMeasurement(
                label=message[:200] if message else None,
                allocated_bytes=_bytes(match["max"], GIB),
            )
        )
        message = None
    return out


# --- transformers' Trainer --------------------------------------------------------------------

_HF_BLOCK = re.compile(r"^\*{5} (?P<split>\S+) metrics \*{5}\s*$")
_HF_LINE = re.compile(r"^\s+(?P<key>\S+)\s+=\s+(?P<value>.*?)\s*$")
_HF_MEM = re.compile(r"^(?P<value>-?\d+)MB$")
#: the tracker's stages in the order a script runs them (``TrainerMemoryTracker.stages``)
_HF_STAGES = ("init", "train", "eval", "test")


def _hf_peaks(metrics: dict[str, int], name: str) -> list[StepMeasurement]:
    """Each stage's allocated peak from the tracker's deltas (bytes)."""
    if "before_init_mem_gpu" not in metrics:
        raise LogError(
            f"{name}: the Trainer's memory metrics lack before_init_mem_gpu (the first metrics "
            "a run prints or saves carry it; run with skip_memory_metrics=False)"
        )
    now = metrics["before_init_mem_gpu"]
    out = []
    for stage in _HF_STAGES:
        alloc = metrics.get(f"{stage}_mem_gpu_alloc_delta")
        peaked = metrics.get(f"{stage}_mem_gpu_peaked_delta")
        if alloc is None or peaked is None:
            continue
        peak = now + alloc + max(0, peaked)
        now += alloc
        if peak > 0:
            out.append(StepMeasurement(label=stage, allocated_bytes=peak))
    return out


def read_hf_trainer(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    text = "\n".join(lines).strip()
    if text.startswith("{") and not any(_HF_BLOCK.match(line) for line in lines):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _fail(name, exc.lineno, f"not JSON ({exc.msg})") from None
        metrics = {
            k: int(v)
            for k, v in data.items()
            if "_mem_gpu" in k and isinstance(v, int | float) and not isinstance(v, bool)
        }
        return _hf_peaks(metrics, name)
    metrics = {}
    inside = False
    for number, line in enumerate(lines, 1):
        if _HF_BLOCK.match(line):
            inside = True
            continue
        row = _HF_LINE.match(line) if inside else None
        if row is None:
            inside = False
            continue
        if "_mem_gpu" not in row["key"]:
            continue
        value = _HF_MEM.match(row["value"])
        if value is None:
            raise _fail(name, number, f"{row['key']}: expected a whole number of MB like 2012MB")
        metrics[row["key"]] = int(value["value"]) * MIB
    return _hf_peaks(metrics, name)


# --- Accelerate -------------------------------------------------------------------------------

_ACC = re.compile(
    r"Total Peak Memory consumed during the (?P<stage>\S+) \(max\): (?P<mib>0*[1-9]\d*)\s*$"
)
_ACC_START = re.compile(r"Total Peak Memory consumed during the")


def read_accelerate(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    out = []
    like = (
        "an Accelerate peak line cut short or altered; expected 'Total Peak Memory consumed "
        "during the train (max): M' (M: MiB, more than 0)"
    )
    for _, _, match in _matches(lines, name, _ACC_START, _ACC, like):
        out.append(StepMeasurement(label=match["stage"], allocated_bytes=int(match["mib"]) * MIB))
    return out


# --- nvidia-smi -------------------------------------------------------------------------------

_SMI_UNIT = {"MiB": MIB, "GiB": GIB, "KiB": 1024}
_SMI_VALUE = re.compile(rf"^(?P<n>{_NUMBER})(?:\s*(?P<unit>[KMG]iB))?$")


def read_nvidia_smi(lines: Sequence[str], name: str) -> list[StepMeasurement]:
    rows = [line for line in lines if line.strip()]
    if not rows:
        return []
    header = [h.strip() for h in next(csv.reader(io.StringIO(rows[0])))]
    used = next((i for i, h in enumerate(header) if h.split(" ")[0] == "memory.used"), None)
    if used is None:
        raise _fail(
            name,
            1,
            "an nvidia-smi CSV needs its header with memory.used (--query-gpu=...,memory.used "
            "--format=csv, without noheader)",
        )
    unit_in_header = re.search(r"\[(\w+)\]", header[used])
    header_unit = _SMI_UNIT.get(unit_in_header.group(1), MIB) if unit_in_header else MIB
    index = header.index("index") if "index" in header else None
    out = []
    for number, line in enumerate(lines, 1):
        if number == 1 or not line.strip():
            continue
        cells = [c.strip() for c in next(csv.reader(io.StringIO(line)))]
        if len(cells) != len(header):
            raise _fail(
                name,
                number,
                f"expected {len(header)} columns as the header names, not "
                f"{len(cells)} (cut short?)",
            )
        value = _SMI_VALUE.match(cells[used])
        if value is None:
            if cells[used] == "[N/A]":
                continue
            raise _fail(name, number, f"memory.used: expected a number of MiB, got {cells[used]!r}")
        unit = _SMI_UNIT[value["unit"]] if value["unit"] else header_unit
        if float(value["n"]) <= 0:
            continue
        gpu = cells[index] if index is not None else ""
        out.append(
            StepMeasurement(
                rank=int(gpu) if gpu.isdigit() else None, nvidia_smi_bytes=_bytes(value["n"], unit)
            )
        )
    return out


# --- recognising and reading ------------------------------------------------------------------

Reader = Callable[[Sequence[str], str], list[StepMeasurement]]
TEXT_READERS: dict[str, Reader] = {
    "megatron": read_megatron,
    "torchtitan": read_torchtitan,
    "deepspeed": read_deepspeed,
    "hf_trainer": read_hf_trainer,
    "accelerate": read_accelerate,
    "nvidia_smi": read_nvidia_smi,
}
#: every format ``calibrate ingest`` reads (``published``: the published-runs file)
FORMATS: tuple[str, ...] = (*TEXT_READERS, "memory_snapshot", "published")

#: how a text format is recognised: a line (ANSI colours removed) matching its signature
_SIGNATURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("megatron", _MEGATRON_START),
    ("torchtitan", _TITAN_START),
    ("deepspeed", _DS_START),
    ("hf_trainer", re.compile(r"_mem_gpu_(?:alloc|peaked)_delta")),
    ("accelerate", _ACC_START),
    ("nvidia_smi", re.compile(r"^(?:[^,]*, )*memory\.used\b")),
)


def detect(data: bytes, name: str) -> str:
    """The format of a log's content (``FORMATS``); a LogError naming what was looked for when
    none matches."""
    if data[:1] == b"\x80":
        return "memory_snapshot"
    head = data[:4096].lstrip()
    if head.startswith(b"{") and b'"runs"' in data[:65536] and b'"figure"' in data:
        return "published"
    for line in _text_lines(data, name):
        for fmt, signature in _SIGNATURES:
            if signature.search(line):
                return fmt
    raise LogError(
        f"{name}: no memory line of a known format (allowed: {', '.join(FORMATS)}); "
        "name the format with --format if it is one of them"
    )


def read_log(data: bytes, name: str, fmt: str | None = None) -> LogReading:
    """One log's figures (``fmt``: its format, else recognised from the content)."""
    if len(data) > MAX_LOG_BYTES:
        raise LogError(f"{name}: larger than {MAX_LOG_BYTES // MIB} MiB, the largest log read")
    if fmt is not None and fmt not in FORMATS:
        raise LogError(f"format: unknown {fmt!r}; allowed: {', '.join(FORMATS)}")
    fmt = fmt or detect(data, name)
    if fmt == "published":
        raise LogError(f"{name}: the published-runs file holds many runs; read it with runs()")
    try:
        reading = _reading(data, name, fmt)
        reading.measurement()  # what a record holds, checked with the rest of the log
    except ValidationError as exc:  # a figure past 1 PiB, or a label past 200 characters
        error = exc.errors()[0]
        raise LogError(
            f"{name}: a figure a measurement cannot hold ({error['msg']}, got "
            f"{str(error.get('input'))[:80]!r})"
        ) from None
    return reading


def _reading(data: bytes, name: str, fmt: str) -> LogReading:
    if fmt == "memory_snapshot":
        from headroom.calibration.snapshot import read_devices, snapshot_steps

        devices = read_devices(data, name)
        top = max(devices, key=lambda d: d.allocated_peak)
        return LogReading(
            fmt, name, tuple(snapshot_steps(devices)), phase=top.peak_phase, buckets=top.buckets
        )
    steps = TEXT_READERS[fmt](_text_lines(data, name), name)
    if not steps:
        raise LogError(f"{name}: no {fmt} memory line with a number in it")
    return LogReading(fmt, name, tuple(steps))


def read_path_bytes(path: Path) -> bytes:
    """A log file's bytes; an unreadable or oversized file refused naming it."""
    try:
        if path.stat().st_size > MAX_LOG_BYTES:
            raise LogError(f"{path}: larger than {MAX_LOG_BYTES // MIB} MiB, the largest log read")
        return path.read_bytes()
    except OSError as exc:
        raise LogError(f"{path}: cannot read ({exc.strerror or exc})") from None


def published_measurement(run: dict[str, Any]) -> Measurement | None:
    """A published run's figure as a measurement (None: an OOM, or no number)."""
    figure, value = run.get("figure"), run.get("measured_gib")
    if value is None or figure not in (
        "max_allocated",
        "peak_active",
        "max_reserved",
        "nvidia_smi_total",
    ):
        return None
    key = {
        "max_allocated": "allocated_bytes",
        "peak_active": "allocated_bytes",
        "max_reserved": "reserved_bytes",
        "nvidia_smi_total": "nvidia_smi_bytes",
    }[figure]
    return Measurement(**{key: _bytes(str(value), GIB)}, log_format="published")
