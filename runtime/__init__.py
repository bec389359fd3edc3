"""Headroom's bundled trainer: streaming offload, optimizer offload or resident state, on torch.

- ``trainer``: ``train_model`` runs a spec (``RunConfig``: steps, device, dtype) and returns its
  ``Result``; persistent state stays in pinned host RAM and layers stream through the device
  (double-buffered, CPU AdamW, block-wise recompute), or a fraction of the optimizer is offloaded;
- ``model``: the built-in decoder family (dense, MoE, multi-head latent attention), ``build_model``;
- ``adam``: the CPU AdamW of offloaded fp32 state (torch's fused kernel, chunk by chunk);
- ``streams``: the host-to-device and device-to-host copies' backends;
- ``probe``: ``MemoryProbe``, the per-phase memory snapshots a run reports
  (``planner.report.TrainerReport``);
- ``cap``: ``DeviceCap``, a simulated device-memory cap for CPU runs;
- ``support``: which specs the trainer runs, and whether a model's states fit the machine.

``headroom train`` is its command; the launch layer starts it as a process.
"""

from headroom.runtime.cap import DeviceCap
from headroom.runtime.model import build_model
from headroom.runtime.probe import MemoryProbe
from headroom.runtime.support import check_memory_holds, check_supported
from headroom.runtime.trainer import Result, RunConfig, train_model

__all__ = [
    "DeviceCap",
    "MemoryProbe",
    "Result",
    "RunConfig",
    "build_model",
    "check_memory_holds",
    "check_supported",
    "train_model",
]
