"""This host's devices: its GPUs through NVML (nvidia-ml-py, imported as ``pynvml``), where a
run trains, and the host RAM a CPU run may use."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from headroom.planner import format_bytes

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


#: the share of the host's available RAM a CPU run (or probe) may be predicted to take
HOST_RAM_SHARE = 0.8


def cpu_ram_refusal(
    what: str,
    *,
    device: str,
    gpu_peak_bytes: int,
    host_peak_bytes: int,
    cuda_context_bytes: int,
) -> str | None:
    """Why ``what`` (training, a probe) on ``device`` would exhaust this host's RAM (None: it
    will not, or it trains on a GPU). On the CPU the simulated card is host RAM too: its
    predicted peak (without the CUDA context a CPU has none of) adds to the host's own."""
    if device != "cpu":
        return None
    needed = gpu_peak_bytes - cuda_context_bytes + host_peak_bytes
    available = host_ram_available()
    if available is not None and needed > HOST_RAM_SHARE * available:
        return (
            f"refused: {what} on the CPU needs about {format_bytes(needed)} of host RAM and "
            f"{format_bytes(available)} is available"
        )
    return None
