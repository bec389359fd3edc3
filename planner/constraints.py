"""What a plan is told to keep: the layout keys a training spec names, each a constraint.

``headroom plan`` and ``POST /plan`` choose a run's layout: its parallel degrees and ZeRO
stage, batch shape, recompute, offload and allocator mode (``LAYOUT_KEYS``). A key the training
spec names (in ``--train``'s file or run preset, with ``--set``, or in the body's ``train``
object) narrows the search to the layouts and per-rank choices with that value; the others are
the plan's to choose. ``split_plan_train`` takes those keys out of the spec's raw object before
the rest is validated as a ``TrainSpec``: a key given alone (``parallel.vpp`` without
``parallel.pp``, ``parallel.ep`` without ``parallel.dp``) is a constraint, not a spec the
``TrainSpec``'s cross-field checks refuse. Each value is validated as the ``TrainSpec`` field of
that name validates it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from headroom.planner.errors import SpecError
from headroom.planner.io import load_train, validation_message
from headroom.planner.train import Offload, Parallel, Recompute, RecomputePolicy, TrainSpec

#: the training-spec keys a plan chooses, and the ``PlanConstraints`` field each one sets
LAYOUT_KEYS: dict[str, str] = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.vpp": "vpp",
    "parallel.cp": "cp",
    "parallel.ep": "ep",
    "parallel.dp": "dp",
    "parallel.zero_stage": "zero_stage",
    "parallel.sequence_parallel": "sequence_parallel",
    "micro_batch_size": "micro_batch_size",
    "grad_accum_steps": "grad_accum_steps",
    "recompute": "recompute",
    "offload.mode": "offload_mode",
    "offload.fraction": "offload_fraction",
    "offload.checkpoint_every": "offload_checkpoint_every",
    "expandable_segments": "expandable_segments",
}


def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """A validator of one field of ``model``: its type, bounds and checks, without the model's
    checks across fields."""
    field = model.model_fields[name]
    annotation: Any = field.annotation
    if field.metadata:
        annotation = Annotated[annotation, *field.metadata]
    return TypeAdapter(annotation)


_OWNERS: dict[str, type[BaseModel]] = {"parallel": Parallel, "offload": Offload}
_ADAPTERS = {
    key: _adapter(_OWNERS.get(key.partition(".")[0], TrainSpec), key.rpartition(".")[2])
    for key in LAYOUT_KEYS
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConstraints:
    """The layout keys a training spec named: each narrows the plan's search to its value
    (None: the plan chooses)."""

    tp: int | None = None
    """``parallel.tp``: the tensor-parallel degree."""
    pp: int | None = None
    """``parallel.pp``: the pipeline stages."""
    vpp: int | None = None
    """``parallel.vpp``: virtual stages per rank (1: 1F1B)."""
    cp: int | None = None
    """``parallel.cp``: the context-parallel degree."""
    ep: int | None = None
    """``parallel.ep``: the expert-parallel degree."""
    dp: int | None = None
    """``parallel.dp``: the data-parallel replicas."""
    zero_stage: int | None = None
    """``parallel.zero_stage``: the ZeRO stage (else the framework's stages are searched)."""
    sequence_parallel: bool | None = None
    """``parallel.sequence_parallel`` (else on wherever tp > 1)."""
    micro_batch_size: int | None = None
    """``micro_batch_size``."""
    grad_accum_steps: int | None = None
    """``grad_accum_steps``: micro-batches per step (global batch = dp x micro x this)."""
    recompute: RecomputePolicy | None = None
    """``recompute``: the policy, or ``{"every_k": K}``."""
    offload_mode: str | None = None
    """``offload.mode``."""
    offload_fraction: float | None = None
    """``offload.fraction``: the share of the optimizer an optimizer offload moves."""
    offload_checkpoint_every: int | None = None
    """``offload.checkpoint_every``: a streaming placement's layers per block."""
    expandable_segments: bool | None = None
    """``expandable_segments`` (else each candidate is tried with and without)."""

    def given(self) -> dict[str, Any]:
        """The constraints as the training spec names them (``parallel.tp``: 8 ...)."""
        out: dict[str, Any] = {}
        for key, name in LAYOUT_KEYS.items():
            value = getattr(self, name)
            if value is not None:
                out[key] = value.model_dump() if isinstance(value, Recompute) else value
        return out

    def text(self) -> str:
        """``parallel.tp=8, recompute=full``, or ``none``."""
        given = self.given()
        return ", ".join(f"{k}={v}" for k, v in given.items()) if given else "none"


def split_plan_train(data: Mapping[str, Any] | None) -> tuple[TrainSpec, PlanConstraints]:
    """A plan's training spec (the raw object of ``--train``/``--set`` or a body's ``train``)
    as what the plan keeps (validated as a ``TrainSpec``) and the layout keys it names
    (validated each as its field, a ``SpecError`` naming ``train.<key>`` otherwise)."""
    if data is None:
        return load_train(None), PlanConstraints()
    if not isinstance(data, Mapping):
        raise SpecError(f"train: expected an object, got {type(data).__name__}", field="train")
    rest: dict[str, Any] = dict(data)
    for section in _OWNERS:
        if isinstance(rest.get(section), Mapping):
            rest[section] = dict(rest[section])
    values: dict[str, Any] = {}
    for key, name in LAYOUT_KEYS.items():
        section, _, leaf = key.rpartition(".")
        holder = rest.get(section) if section else rest
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        raw = holder.pop(leaf)
        try:
            values[name] = _ADAPTERS[key].validate_python(raw)
        except ValidationError as exc:
            raise SpecError(validation_message(exc, f"train.{key}"), field=f"train.{key}") from None
    return load_train(rest), PlanConstraints(**values)
