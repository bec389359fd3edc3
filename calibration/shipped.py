"""The shipped ``runtime``, ``hf`` and ``torchtitan`` coefficient sets: regressed onto the
committed traces (the records not held out) and written into
``planner/data/coefficients.json``.

Run: ``python -m headroom.calibration.shipped``. The other sets in the file are kept as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from headroom.calibration.regression import FAMILY, FITTED, STRUCTURAL, fit_coefficients
from headroom.calibration.trace_records import PACKAGES, TraceRecord, load_traces, traces_path
from headroom.planner.untraced import ARCHITECTURE_OPTIONS, architecture_options

#: the planner's coefficients file, which ships the sets
SHIPPED = Path(str(resources.files("headroom.planner") / "data" / "coefficients.json"))
#: the implementation each profile with committed traces describes
ABOUT = {
    "runtime": "Headroom's trainer",
    "hf": "transformers models (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, "
    "deepseek_v3; SDPA as on a GPU, grouped_mm experts)",
    "torchtitan": "torchtitan's Llama 3 model code (fused Q/K/V, FlexAttention as the GPU "
    "kernels allocate it, its cross_entropy_loss and FullAC)",
    "megatron": "Megatron-Core's GPT with its local layers (flash attention as a GPU kernel "
    "allocates it, its vocab_parallel_cross_entropy)",
    "torchtune": "torchtune's Llama 3.2 decoder code (fp32 RMSNorm, expanded grouped keys "
    "and values, fp32 logits, its recipes' cross entropy and activation checkpointing)",
}


def shipped_entry(profile: str) -> dict[str, Any]:
    """The shipped set of ``profile`` as ``coefficients.json`` holds it, regressed onto its
    committed traces (not held out)."""
    traces = load_traces(profile)
    if traces is None:
        raise FileNotFoundError(traces_path(profile))
    fitted = traces.fitted()
    c = fit_coefficients(fitted, profile)
    versions = f"torch {traces.torch}" + "".join(
        f", {package} {getattr(traces, key)}"
        for key, package in PACKAGES.values()
        if getattr(traces, key) is not None
    )
    return {
        "profile": profile,
        "calibrated": True,
        "source": f"activation terms fitted to {c.num_records} CPU traces of {ABOUT[profile]} "
        f"(calibration/data/{traces_path(profile).name}, {versions}; {traces.command}); "
        "allocator and context from the GPU preset",
        "num_records": c.num_records,
        **{name: round(getattr(c, name), 6) for name in FITTED},
        # a kind of layer's terms, where the records have that kind
        **{name: round(getattr(c, name), 6) for name in FAMILY if name in c.model_fields_set},
        "moe_traced": c.moe_traced,
        "selective_op": c.selective_op,
        **STRUCTURAL[profile],
        "untraced": untraced(profile, traces.records),
    }


def untraced(profile: str, records: Sequence[TraceRecord]) -> list[str]:
    """What ``profile``'s traces never ran: the options its structure names
    (``STRUCTURAL``), and the architecture's options none of its ``records`` (fitted and held
    out) uses, each in ``planner.untraced``'s order."""
    used = {option for record in records for option in architecture_options(record.model)}
    named = list(STRUCTURAL[profile].get("untraced", []))
    return named + [o for o in ARCHITECTURE_OPTIONS if o not in used and o not in named]


def shipped_text() -> tuple[str, list[dict[str, Any]]]:
    """``planner/data/coefficients.json`` with its ``runtime`` and ``hf`` sets regressed again
    onto the committed traces (the others as they are), and its entries."""
    data = json.loads(SHIPPED.read_text())
    entries = [
        shipped_entry(p) if p in ABOUT else e for e in data["coefficients"] for p in [e["profile"]]
    ]
    present = {e["profile"] for e in entries}
    entries += [shipped_entry(p) for p in ABOUT if p not in present]
    lines = ",\n".join(f"    {json.dumps(e)}" for e in entries)
    about = json.dumps(data["about"])
    return f'{{\n  "about": {about},\n  "coefficients": [\n{lines}\n  ]\n}}\n', entries


def main() -> None:
    """Regress the shipped ``runtime`` and ``hf`` sets onto the committed traces and write
    them into ``planner/data/coefficients.json``."""
    text, entries = shipped_text()
    SHIPPED.write_text(text)
    for e in entries:
        print(e["profile"], {k: e[k] for k in FITTED if k in e})


if __name__ == "__main__":
    main()
