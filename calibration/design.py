"""The calibration designs: which configurations ``python -m headroom.calibration.collect``
traces for each implementation, and which of them the shipped coefficients are fitted from.

A design is data (``calibration/designs/<impl>.json``, shipped with the package): a list of
shapes, each with a ``name`` (the traced model's name, as its records carry it), a ``why`` (what
it adds to the design), its model, and its runs. A shape's model is one of

- ``model``: the trainer's model family, these ModelSpec fields over the design's
  ``base_model`` preset;
- ``hf_config``: a transformers ``config.json`` dict, read as ``planner.hf.from_hf_config``
  reads it;
- ``preset_cut``: the planner preset of the shape's name with these fields changed (a published
  model at full width, cut to a few layers).

A run is a micro-batch, a sequence length, a recompute policy and a ``split``: ``fitted`` runs
are what a fit uses, ``held_out`` ones check it. The split is written on every run, so adding
or moving a run changes no other run's split. Every run is traced in bf16 throughout
(:data:`PURE_BF16`, the trainer's GPU precision) with torch AdamW (fused, the spec's default).

The ``megatron`` design may give a run a tensor-parallel degree ``tp`` and
``sequence_parallel``: Megatron-Core's layers shard themselves, traced as rank 0 of ``tp``.

A framework's design (``framework`` other than ``none``: ``hf-fsdp2.json``,
``torchtitan-fsdp2.json``) also gives each run its data-parallel ranks ``dp`` and
tensor-parallel degree ``tp``, and traces it as that framework's default run: for ``fsdp2``
torchtitan's (:data:`FSDP2_PRECISION`, ZeRO stage 3, sequence parallelism with tensor
parallelism, fused AdamW, gradient clipping at 1.0), with the design's ``fsdp2`` knobs
(``torchtitan-fsdp2``: torchtitan's own grouping, ``groups: split``). A shape may also be
``torchtitan_flavor``: torchtitan's own Llama 3 flavor, cut to a few layers.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, model_validator

from headroom import planner
from headroom.planner.hf import from_hf_config

#: the precision of every traced run: one a trace can run (torch AdamW on the working
#: parameters, no master copy), bf16 as the trainer's GPU precision
PURE_BF16 = {"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"}
#: torchtitan's FSDP2 precision: bf16 compute, fp32 reduction (``MixedPrecisionPolicy``),
#: fp32 sharded parameters and AdamW states
FSDP2_PRECISION = {"params": "bf16", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}
#: the implementations that have a design
IMPLS = ("runtime", "hf", "torchtitan", "megatron", "torchtune")
#: the designs traced under a framework (implementation-framework)
FRAMEWORK_DESIGNS = ("hf-fsdp2", "torchtitan-fsdp2")
#: every design: one per implementation, and one per implementation and framework
DESIGNS = (*IMPLS, *FRAMEWORK_DESIGNS)

Split = Literal["fitted", "held_out"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DesignRun(_Frozen):
    """One traced training run of a shape."""

    micro_batch_size: int
    seq_len: int
    #: a TrainSpec ``recompute``: "none", "selective", "full" or {"every_k": K}
    recompute: str | dict[str, int] = "none"
    #: "fitted": a fit uses its record; "held_out": its record checks the fit
    split: Split
    #: data-parallel ranks (a framework's design only)
    dp: int = 1
    #: tensor-parallel degree (a framework's design, or model code that shards itself:
    #: Megatron-Core's, traced as rank 0 of ``tp`` ranks)
    tp: int = 1
    #: Megatron's sequence parallelism with ``tp`` (the megatron design only)
    sequence_parallel: bool = False


class DesignShape(_Frozen):
    """One model of a design and the runs traced with it (module docstring)."""

    name: str
    why: str
    model: dict[str, Any] | None = None
    hf_config: dict[str, Any] | None = None
    preset_cut: dict[str, Any] | None = None
    #: torchtitan's Llama 3 flavor and the layers it is cut to: {"flavor": "8B", "num_layers": 2}
    torchtitan_flavor: dict[str, Any] | None = None
    runs: tuple[DesignRun, ...]

    @model_validator(mode="after")
    def _one_model(self) -> Self:
        kinds = ("model", "hf_config", "preset_cut", "torchtitan_flavor")
        given = [k for k in kinds if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"shape {self.name!r}: give exactly one of {', '.join(kinds)} "
                f"(got {', '.join(given) or 'none'})"
            )
        return self


class Configuration(NamedTuple):
    """One traced configuration of a design."""

    model: planner.ModelSpec
    train: planner.TrainSpec
    held_out: bool


class Design(_Frozen):
    """A design file (module docstring)."""

    about: str
    activation_profile: str
    #: the framework the runs are traced under (``calibration.frameworks.FRAMEWORKS``)
    framework: Literal["none", "fsdp2"] = "none"
    #: the ``fsdp2`` knobs of every run (a framework's design only)
    fsdp2: dict[str, Any] | None = None
    #: the preset whose choices ``model`` shapes start from
    base_model: str | None = None
    #: the ``source`` each design-built model spec carries
    model_source: str
    #: what each of a shape's model keys means (the file's own documentation)
    model_kinds: dict[str, str]
    shapes: tuple[DesignShape, ...]

    @model_validator(mode="after")
    def _parallel_only_under_a_framework(self) -> Self:
        # Megatron-Core's layers shard themselves over tensor-parallel ranks
        shards = self.activation_profile == "megatron"
        if self.framework == "none":
            for shape in self.shapes:
                if any(run.dp != 1 or (run.tp != 1 and not shards) for run in shape.runs):
                    raise ValueError(f"shape {shape.name!r}: dp and tp need a framework (got none)")
                if any(run.sequence_parallel and run.tp == 1 for run in shape.runs):
                    raise ValueError(f"shape {shape.name!r}: sequence_parallel needs tp > 1")
        return self

    def shape(self, name: str) -> DesignShape:
        """The shape named ``name``; KeyError naming the design's shapes if none is."""
        for shape in self.shapes:
            if shape.name == name:
                return shape
        raise KeyError(f"{name!r}: not a shape of the {self.activation_profile} design")

    def model_spec(self, shape: DesignShape) -> planner.ModelSpec:
        """The planner's model of ``shape``, named after it."""
        if shape.hf_config is not None:
            spec = from_hf_config({**shape.hf_config, "_name_or_path": shape.name})
            return spec.model_copy(update={"source": self.model_source})
        if shape.preset_cut is not None:
            return planner.load_model(shape.name).model_copy(update=shape.preset_cut)
        if shape.torchtitan_flavor is not None:
            from headroom.calibration.torchtitan import flavor_spec

            return flavor_spec(**shape.torchtitan_flavor, name=shape.name)
        if self.base_model is None:
            raise ValueError(f"shape {shape.name!r}: a model shape needs the design's base_model")
        return planner.ModelSpec.model_validate(
            {
                **planner.load_model(self.base_model).model_dump(),
                "name": shape.name,
                **(shape.model or {}),
                "source": self.model_source,
            }
        )

    def train_spec(self, run: DesignRun) -> planner.TrainSpec:
        """The training spec ``run`` is traced with."""
        spec: dict[str, Any] = {
            "micro_batch_size": run.micro_batch_size,
            "seq_len": run.seq_len,
            "recompute": run.recompute,
            "precision": PURE_BF16,
            "activation_profile": self.activation_profile,
        }
        if self.framework == "none" and run.tp > 1:  # Megatron-Core's own sharding
            spec["parallel"] = {"tp": run.tp, "sequence_parallel": run.sequence_parallel}
        if self.framework == "fsdp2":
            spec["framework"] = "fsdp2"
            spec["precision"] = FSDP2_PRECISION
            spec["parallel"] = {
                "dp": run.dp,
                "tp": run.tp,
                "zero_stage": 3,
                "sequence_parallel": run.tp > 1,
            }
            if self.fsdp2 is not None:
                spec["fsdp2"] = self.fsdp2
        return planner.TrainSpec.model_validate(spec)

    def configurations(self) -> list[Configuration]:
        """Every run of every shape, in the file's order (the order of the traced records)."""
        out = []
        for shape in self.shapes:
            model = self.model_spec(shape)
            for run in shape.runs:
                out.append(Configuration(model, self.train_spec(run), run.split == "held_out"))
        return out


@cache
def load_design(impl: str) -> Design:
    """The shipped design ``impl`` (``calibration/designs/<impl>.json``; one of
    :data:`DESIGNS`)."""
    if impl not in DESIGNS:
        raise planner.SpecError(
            f"impl: no calibration design for {impl!r}; allowed: {', '.join(DESIGNS)}",
            field="impl",
        )
    path = resources.files("headroom.calibration") / "designs" / f"{impl}.json"
    return Design.model_validate(json.loads(path.read_text()))


def configurations(impl: str = "runtime") -> list[Configuration]:
    """(model, train, held out) of every configuration ``impl``'s design traces."""
    return load_design(impl).configurations()


def deepseek_cut() -> planner.ModelSpec:
    """DeepSeek-V3 at full width cut to its three dense layers and first MoE layer, without the
    multi-token-prediction module (transformers builds none; the planner reports it apart)."""
    hf = load_design("hf")
    return hf.model_spec(hf.shape("deepseek-v3"))
