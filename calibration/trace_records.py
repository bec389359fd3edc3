"""Trace records: what one traced configuration measured, typed, and the committed files that
hold them (``calibration/data/<profile>-traces.json``, written by
``python -m headroom.calibration.collect``). A framework's traces (``hf-fsdp2-traces.json``)
are :class:`FrameworkTraceRecord` s in a :class:`FrameworkTracesFile`: the same record, plus
what the framework's tracker tells per phase.

A record's JSON keys are its fields, in this order; a file written from these types is the
file the collector has always written. Records read from the store (``headroom calibrate
trace --record``) carry what a fit needs and their calibration ``uid``, nothing more.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from headroom import planner


class TracePeak(BaseModel):
    """A trace's bytes per tracker category at its peak (``calibration.tracing``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params: int
    grads: int
    optimizer_states: int
    #: activations, temporaries and everything else the tracker does not name
    transient: int
    total: int


class TraceRecord(BaseModel):
    """One traced configuration: its specs, its split and what the trace measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: planner.ModelSpec
    train: planner.TrainSpec
    #: whether the record checks a fit rather than feeding it (the design's ``split``)
    held_out: bool = False
    #: "fake" (fake tensors) or "real" (real tensors), as the trace ran; None from the store
    mode: str | None = None
    #: live bytes at the end of step 2's forward beyond what the step began with
    forward_transient_bytes: int
    #: the trace's largest total (what the planner's allocated peak is compared with)
    peak_bytes: int
    #: the largest total inside a decoder layer's backward; None where not measured
    layer_backward_peak_bytes: int | None = None
    #: the peak per category; None from the store
    peak: TracePeak | None = None
    #: the store's calibration uid of a record read from the store; never written to a file
    uid: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a traces file holds it."""
        return self.model_dump(mode="json", exclude={"uid"})


#: the model-code package each implementation's traces name: impl -> (the traces file's key,
#: the distribution whose version it holds)
PACKAGES = {
    "hf": ("transformers", "transformers"),
    "torchtitan": ("torchtitan", "torchtitan"),
    "megatron": ("megatron_core", "megatron-core"),
    "torchtune": ("torchtune", "torchtune"),
}


class TracesFile(BaseModel):
    """A committed traces file: provenance and records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    about: str
    #: the command that wrote it
    command: str
    torch: str
    python: str
    #: ISO date
    created: str
    records: tuple[TraceRecord, ...]
    #: the transformers version of an ``hf`` file
    transformers: str | None = None
    #: the torchtitan version of a ``torchtitan`` file
    torchtitan: str | None = None
    #: the megatron-core version of a ``megatron`` file
    megatron_core: str | None = None
    #: the torchtune version of a ``torchtune`` file
    torchtune: str | None = None

    def fitted(self) -> list[TraceRecord]:
        """The records a fit uses (those not held out)."""
        return [r for r in self.records if not r.held_out]

    def held_out(self) -> list[TraceRecord]:
        """The records that check a fit."""
        return [r for r in self.records if r.held_out]

    def to_json_text(self) -> str:
        """The file's text (one space of indent, as committed)."""
        keys = [key for key, _ in PACKAGES.values()]
        payload = self.model_dump(mode="json", exclude={"records", *keys})
        payload["records"] = [r.to_json() for r in self.records]
        for key in keys:
            if getattr(self, key) is not None:
                payload[key] = getattr(self, key)
        return json.dumps(payload, indent=1) + "\n"


class FrameworkTraceRecord(TraceRecord):
    """A configuration traced under a training framework (``calibration.frameworks``): the
    record's fields, and per phase the framework tracker's categories at that phase's largest
    total. Its ``peak`` sums the categories into the compared buckets (gathered parameters and
    all-gather outputs in ``params``, reduce-scatter inputs in ``grads``)."""

    #: the phase of the largest total (``calibration.frameworks.fsdp2.PHASES``)
    peak_phase: str
    #: phase → tracker category → bytes at the phase's largest total (zero categories left
    #: out), and the phase's ``total``
    phases: dict[str, dict[str, int]]


class FrameworkTracesFile(TracesFile):
    """A committed file of a framework's traces."""

    #: the framework the records were traced under (``fsdp2``)
    framework: str
    records: tuple[FrameworkTraceRecord, ...]


def traces_path(profile: str) -> Path:
    """Where the committed traces of ``profile`` live."""
    return Path(str(resources.files("headroom.calibration") / "data" / f"{profile}-traces.json"))


def load_traces(profile: str) -> TracesFile | None:
    """The committed traces file of ``profile``, None if there is none."""
    path = traces_path(profile)
    if not path.is_file():
        return None
    return TracesFile.model_validate_json(path.read_text())


def load_framework_traces(name: str) -> FrameworkTracesFile | None:
    """The committed traces file ``name`` (``hf-fsdp2``) of a framework, None if there is none."""
    path = traces_path(name)
    if not path.is_file():
        return None
    return FrameworkTracesFile.model_validate_json(path.read_text())


def fitted_records(traces: TracesFile | None) -> list[TraceRecord]:
    """The records of a traces file that a fit uses (none without a file)."""
    return traces.fitted() if traces else []
