"""This host's devices: its GPUs through NVML (nvidia-ml-py, imported as ``pynvml``), where a
run trains, and the host RAM a CPU run may use."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

DeviceChoice = Literal["auto", "cpu", "cuda"]


def local_gpus() -> dict[str, Any]:
    """``{"gpus": [...], "reason": None}``, or an empty list and why there is none."""
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - a dependency of the service
        return {"gpus": [], "reason": f"nvidia-ml-py is not installed: {exc}"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"gpus": [], "reason": f"NVML unavailable: {exc}"}
    try:
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_total_bytes": int(memory.total),
                    "memory_used_bytes": int(memory.used),
                    "memory_free_bytes": int(memory.free),
                }
            )
        return {"gpus": out, "reason": None if out else "NVML reports no devices"}
    except pynvml.NVMLError as exc:
        return {"gpus": [], "reason": f"NVML error: {exc}"}
    finally:
        pynvml.nvmlShutdown()


def resolve_device(choice: DeviceChoice | str) -> str:
    """``cpu`` or ``cuda``: ``auto`` is cuda when NVML sees a GPU."""
    if choice != "auto":
        return choice
    return "cuda" if local_gpus()["gpus"] else "cpu"


def host_ram_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
