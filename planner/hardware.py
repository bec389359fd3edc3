"""Hardware: a GPU (memory, bf16 FLOP/s, host link) and the host it sits in.

GPU presets are data files in ``planner/data/gpus/`` with their sources; custom hardware comes
from a JSON/YAML file with the same fields.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Annotated

from pydantic import ConfigDict, Field

from headroom.planner._keys import FewUnknownKeys, at_most
from headroom.planner._numbers import INTEGER, NUMBER, Float, Int
from headroom.planner.errors import UnknownPresetError, did_you_mean

#: text ends up in database columns and JSON responses: no NUL, and valid Unicode (the pattern
#: check refuses lone surrogates, which no UTF-8 encoder writes)
_TEXT = r"^[^\x00]*$"
#: GPUs that may share one host's RAM (the host-RAM check multiplies by it): the CLI's
#: ``--gpus-per-node`` and the service's ``gpus_per_node`` are held to the same bound
MAX_GPUS_PER_NODE = 1024
#: host RAM of one node: at most 1 PiB, a number every JSON client holds exactly (a double holds
#: integers to 2^53; at 2^60 the bound itself was not one a client could check)
MAX_HOST_MEMORY_BYTES = 2**50
#: other names of a preset (each a key of the preset table)
_MAX_ALIASES = 32


class Hardware(FewUnknownKeys):
    """One GPU and its share of the host."""

    # finite numbers in ranges that keep every estimate and step time finite
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=100, pattern=_TEXT)
    aliases: Annotated[
        tuple[Annotated[str, Field(max_length=100, pattern=_TEXT)], ...],
        at_most(_MAX_ALIASES, "aliases"),
    ] = ()
    memory_bytes: Int = Field(ge=1, le=2**50, description="Device memory as the driver reports it.")
    bf16_flops: Float = Field(ge=1, le=1e21, description="Dense bf16 tensor-core FLOP/s.")
    memory_bandwidth_bytes_per_s: Float = Field(ge=1, le=1e16)
    host_link: str = Field(
        max_length=200, pattern=_TEXT, description="Host interconnect, e.g. 'PCIe Gen5 x16'."
    )
    host_link_bytes_per_s: Float = Field(ge=1, le=1e16, description="Per direction.")
    cuda_context_bytes: Int = Field(
        ge=0, le=2**50, description="Uncalibrated default context size."
    )
    allocator_overhead_fraction: Float = Field(
        ge=0, lt=1, description="Uncalibrated default: reserved minus allocated, over allocated."
    )
    compute_efficiency: Annotated[float, Field(gt=0, le=1), NUMBER] | None = Field(
        default=None,
        description="Achieved over peak bf16 FLOP/s of training's matrix multiplies on this GPU, "
        "fitted to published runs on it (calibration/throughput.py); wins over the "
        "coefficients' compute_efficiency, which a GPU without a fit of its own uses.",
    )
    host_memory_bytes: Annotated[int, Field(ge=1, le=MAX_HOST_MEMORY_BYTES), INTEGER] | None = (
        Field(default=None, description="Host RAM available to the GPUs of one node.")
    )
    gpus_per_node: Int = Field(
        default=1, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs sharing the host RAM."
    )
    source: str = Field(
        default="custom", max_length=4000, pattern=_TEXT, description="Where the numbers come from."
    )


def compute_efficiency(hw: Hardware, coeffs_efficiency: float) -> float:
    """The fraction of ``hw.bf16_flops`` the step-time model prices matrix multiplies at: the
    GPU's own fit where published runs on it gave one, else the coefficients'."""
    return coeffs_efficiency if hw.compute_efficiency is None else hw.compute_efficiency


@cache
def _presets() -> dict[str, Hardware]:
    found: dict[str, Hardware] = {}
    folder = resources.files("headroom.planner") / "data" / "gpus"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            hw = Hardware(**json.loads(entry.read_text()))
            for key in (hw.name, *hw.aliases):
                found[key.lower()] = hw
    return found


def gpu_names() -> list[str]:
    """Canonical names of the bundled GPU presets."""
    return sorted({hw.name for hw in _presets().values()})


def unknown_gpu(name: str) -> str:
    """Why ``name`` is no GPU preset: the closest one (did you mean) and every one."""
    closest = did_you_mean(name, {alias: p.name for alias, p in _presets().items()})
    return f"unknown preset {name!r}{closest}; allowed: {', '.join(gpu_names())}"


def gpu(name: str) -> Hardware:
    """A bundled GPU preset by name or alias (case-insensitive)."""
    hw = _presets().get(name.strip().lower())
    if hw is None:
        raise UnknownPresetError(f"gpu: {unknown_gpu(name)}", field="gpu")
    return hw
