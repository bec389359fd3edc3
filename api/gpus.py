"""This host's GPUs through NVML (nvidia-ml-py, imported as ``pynvml``)."""

from __future__ import annotations

from typing import Any


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
