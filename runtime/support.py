"""What the bundled trainer can train: the planner's rules (``planner.trainable``), and the
check that a model's states fit this machine at all, which only the trainer process makes."""

from __future__ import annotations

import os

from headroom.planner.errors import SpecError
from headroom.planner.model import ModelSpec
from headroom.planner.trainable import (
    TORCH_DTYPE,
    WORKING,
    Working,
    check_recompute,
    check_supported,
    runtime_precision,
    runtime_train,
    working_precision,
)

__all__ = [
    "LEAST_STATE_BYTES",
    "TORCH_DTYPE",
    "WORKING",
    "Working",
    "check_memory_holds",
    "check_recompute",
    "check_supported",
    "runtime_precision",
    "runtime_train",
    "working_precision",
]

#: the fewest bytes per parameter any AdamW run keeps: 16-bit weights and gradients, fp32 moments
LEAST_STATE_BYTES = 12


def check_memory_holds(spec: ModelSpec, device_bytes: int = 0) -> None:
    """Refuse, naming ``model``, a model whose states cannot fit this machine's RAM and
    ``device_bytes`` of device memory together, whatever the placement: building it would
    only end in the kernel's out-of-memory kill."""
    from headroom.planner import count_params, format_bytes

    n = count_params(spec).total
    need = n * LEAST_STATE_BYTES
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram + device_bytes:
        where = "memory" if not device_bytes else "memory and device memory"
        raise SpecError(
            f"model: {spec.name} has {n:,} parameters; training them keeps at least "
            f"{format_bytes(need)} (16-bit weights and gradients, fp32 AdamW moments), more "
            f"than this machine's {format_bytes(ram + device_bytes)} of {where}",
            field="model",
        )
