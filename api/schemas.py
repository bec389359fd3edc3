"""Request and response bodies of the service (pydantic v2, strict about unknown keys)."""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    field_validator,
)
from pydantic_core import PydanticCustomError

from headroom import planner, store
from headroom.api.forms import (
    ClusterInput,
    GpuInput,
    HostMemoryInput,
    ModelInput,
    TrainInput,
    documented_as,
    mapped_train,
    stack_shape,
)
from headroom.calibration.logs import FORMATS as LOG_FORMATS
from headroom.launch.slurm import SlurmOverrides
from headroom.planner._keys import FewUnknownKeys, at_most
from headroom.planner.budget import GPU_BUCKETS, PHASES
from headroom.planner.cluster import cluster_preset
from headroom.planner.hardware import MAX_GPUS_PER_NODE
from headroom.planner.layout import MAX_PLAN_GPUS, TIE_BAND_PCT

PhaseName = Literal[PHASES]  # type: ignore[valid-type]
BucketName = Literal[GPU_BUCKETS]  # type: ignore[valid-type]

_MODEL = (
    "A bundled model preset by name, our model spec, or a Hugging Face config.json of a "
    "supported model_type."
)
_GPU = "A GPU preset by name or alias (GET /presets; any case) or a hardware object."
_TRAIN = "The training spec (default: every key's default)."


#: text that ends up in a database column: PostgreSQL refuses NUL in text
_NO_NUL = r"^[^\x00]*$"


def _preset_model(value: Any) -> Any:
    """A model given by name must be a bundled preset: the service reads no server files."""
    if isinstance(value, str) and value not in planner.model_names():
        raise ValueError(
            f"unknown model preset {value[:100]!r}; allowed: {', '.join(planner.model_names())}"
        )
    return value


def _preset_gpu(value: Any) -> Any:
    """A GPU given by name must be a bundled preset (or alias): no server files either."""
    if isinstance(value, str):
        try:
            planner.gpu(value)
        except planner.UnknownPresetError:
            allowed = ", ".join(planner.gpu_names())
            raise ValueError(f"unknown GPU preset {value[:100]!r}; allowed: {allowed}") from None
    return value


def _finite(value: Any) -> Any:
    """Refuse NaN and infinity before the range check, which would call NaN "more than 100"
    (every comparison with NaN is false) and infinity merely too large."""
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError(
            "finite_number",
            "Input should be a finite number from 0 to 100, got {value}",
            {"value": str(value)},
        )
    return value


def _not_a_boolean(value: Any) -> Any:
    # pydantic's lax int and float read a JSON true as 1: one byte of host RAM, one GPU
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a boolean ({str(value).lower()})")
    return value


#: a number that is not a boolean, for a bounded field inside a union or a collection
#: (``Annotated[int, Field(ge=0), NUMBER] | None``: bounds first, or the schema loses them)
NUMBER = BeforeValidator(_not_a_boolean)
#: a safety margin in % of the peak: a finite number from 0 to 100
MarginPct = Annotated[float, Field(ge=0, le=100), BeforeValidator(_finite), NUMBER]
_MARGIN = "Safety margin in % of the peak (default: the coefficients' margin)."


class _In(FewUnknownKeys):
    """A request body: unknown keys are refused (many of them at once, ``planner._keys``)."""

    model_config = ConfigDict(extra="forbid")

    _model_is_preset = field_validator("model", check_fields=False)(_preset_model)
    _gpu_is_preset = field_validator("gpu", check_fields=False)(_preset_gpu)
    _train_of_a_stack = field_validator("train", check_fields=False)(stack_shape)
    _train_mapped: tuple[dict[str, Any] | None, list[str]] | None = PrivateAttr(default=None)

    def train_of(self, model: planner.ModelSpec) -> dict[str, Any] | None:
        """The body's ``train`` as a training spec's raw dict (a stack's own config mapped:
        ``mapped_train``, read once)."""
        if self._train_mapped is None:
            self._train_mapped = mapped_train(getattr(self, "train", None), model)
        return self._train_mapped[0]

    def train_warnings(self) -> list[str]:
        """What mapping a stack's config (``train_of``) did not map or assumed, as warnings."""
        return list(self._train_mapped[1]) if self._train_mapped is not None else []


class PlanningRequest(_In):
    """What every planning route reads: the model, the training spec, the GPU and the host."""

    model: ModelInput = Field(description=_MODEL)
    train: TrainInput = Field(default=None, description=_TRAIN)
    gpu: GpuInput = Field(default="H100-80GB", description=_GPU)
    host_memory: HostMemoryInput = Field(
        default=None, description="Host RAM per node, e.g. '1.5TiB', or bytes."
    )
    gpus_per_node: int | None = Field(default=None, ge=1, le=MAX_GPUS_PER_NODE)

    _numbers_not_booleans = field_validator("host_memory", "gpus_per_node", mode="before")(
        _not_a_boolean
    )


def _preset_cluster(value: Any) -> Any:
    """A cluster given by name must be a bundled preset (or alias): no server files."""
    if isinstance(value, str):
        try:
            cluster_preset(value)
        except planner.UnknownPresetError:
            allowed = ", ".join(planner.cluster_names())
            raise ValueError(
                f"unknown cluster preset {value[:100]!r}; allowed: {allowed}, or an object of "
                "cluster fields"
            ) from None
    return value


class EstimateRequest(PlanningRequest):
    compare: StrictBool = Field(
        default=False,
        description="Also estimate the configuration under every framework and activation "
        "profile (the answer's 'compare'), as `headroom estimate --compare` does.",
    )
    step: StrictBool = Field(
        default=False,
        description="Also price the spec's step as given (its layout fixed, fit or not): the "
        "answer's 'step', its time term by term, tokens/s and MFU, as `headroom estimate "
        "--step` does.",
    )
    cluster: ClusterInput = Field(
        default=None,
        description="With step: the cluster preset name or object whose links price the "
        "collectives; default: the preset of the GPU's nodes.",
    )
    _cluster_is_preset = field_validator("cluster")(_preset_cluster)


class EstimateResponse(planner.BudgetModel):
    """The estimate, with ``compare`` the configuration under every framework and activation
    profile, and with ``step`` the spec's step."""

    compare: list[planner.Comparison] | None = None
    step: planner.StepPrice | None = None


class GateRequest(PlanningRequest):
    margin_pct: MarginPct | None = Field(default=None, description=_MARGIN)
    require_calibration: StrictBool = Field(
        default=False,
        description="Refuse to decide (decision 'undecided') on uncalibrated coefficients.",
    )


class FitRequest(PlanningRequest):
    margin_pct: MarginPct | None = Field(default=None, description=_MARGIN)


#: most GPUs the service plans for in one request: a search there takes about a second on one
#: core (docs/PERFORMANCE.md), one search thread serves them all
MAX_SERVED_PLAN_GPUS = 1024


class PlanRequest(_In):
    """``headroom plan``'s question: the fastest parallel layout of ``gpus`` GPUs that fits."""

    model: ModelInput = Field(description=_MODEL)
    train: TrainInput = Field(
        default=None,
        description=_TRAIN + " Its precision, optimizer, framework, model code and the rest "
        "are kept. The layout keys it names (parallel.tp, pp, vpp, cp, ep, dp, zero_stage, "
        "sequence_parallel; micro_batch_size, grad_accum_steps, recompute, offload.mode, "
        "offload.fraction, offload.checkpoint_every, expandable_segments) are constraints the "
        "search keeps to, each alone (a 422 names one no layout can meet); the ones it leaves "
        "out are the plan's to choose.",
    )
    gpus: Annotated[int, NUMBER] = Field(
        ge=1,
        le=MAX_SERVED_PLAN_GPUS,
        description="GPUs available (the plan uses at most these; the service plans up to "
        f"{MAX_SERVED_PLAN_GPUS:,} per request, `headroom plan` up to {MAX_PLAN_GPUS:,}).",
    )
    global_batch: Annotated[int, NUMBER] = Field(
        ge=1, le=2**30, description="Sequences per optimizer step."
    )
    seq_len: Annotated[int, NUMBER] = Field(ge=1, le=2**30, description="Tokens per sequence.")
    gpu: GpuInput | None = Field(
        default=None, description=_GPU + " Default: the cluster's GPU preset."
    )
    cluster: ClusterInput = Field(
        default=None,
        description="A cluster preset name (its nodes' GPU, GPUs per node, links, host RAM) or "
        "an object of cluster fields; default: the preset of the GPU's nodes.",
    )
    gpus_per_node: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE), NUMBER] | None = Field(
        default=None, description="GPUs per node (default: the cluster's)."
    )
    margin_pct: MarginPct | None = Field(default=None, description=_MARGIN)
    tie_band_pct: Annotated[float, Field(ge=0, le=50), NUMBER] = Field(
        default=TIE_BAND_PCT,
        description="Steps within this % of the fastest count as equally fast: the plan is the "
        "one of them with the most GPU headroom.",
    )

    _cluster_is_preset = field_validator("cluster")(_preset_cluster)


class Measured(_In):
    allocated_bytes: Annotated[int, NUMBER] = Field(
        gt=0, le=2**50, description="Peak allocated bytes on the GPU."
    )
    reserved_bytes: Annotated[int, Field(gt=0, le=2**50), NUMBER] | None = None
    phase: PhaseName | None = Field(default=None, description="Phase the peak was measured in.")
    buckets: Annotated[
        dict[BucketName, Annotated[int, Field(ge=0, le=2**50), NUMBER]] | None,
        at_most(len(GPU_BUCKETS), "buckets"),
    ] = Field(default=None, description="Measured bytes per GPU bucket, where attributable.")
    forward_transient_bytes: Annotated[int, Field(ge=0, le=2**50), NUMBER] | None = Field(
        default=None,
        description="Transient bytes (activations, logits, MoE dispatch) live at the end of a "
        "steady-state forward, where measured (CPU traces): what calibrate fit fits the "
        "activation terms to.",
    )


class CalibrationIn(_In):
    uid: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Client-chosen id: the same request posted under it again returns the "
        "stored record (200); another request under it is a 409 naming the uid.",
    )
    model: ModelInput = Field(description=_MODEL)
    train: TrainInput = Field(default=None, description=_TRAIN)
    gpu: GpuInput = Field(default="H100-80GB", description=_GPU)
    measured: Measured
    source: Literal["runtime", "probe", "trace", "external"] = "external"
    notes: str = Field(default="", max_length=4000, pattern=_NO_NUL)


_LOG_NAME = Field(
    min_length=1, max_length=200, pattern=_NO_NUL, description="What the log is called."
)


class LogText(_In):
    """A log as text."""

    name: str = _LOG_NAME
    text: str = Field(description="The log's text.")


class LogBase64(_In):
    """A log as base64 bytes (a memory snapshot's pickle)."""

    name: str = _LOG_NAME
    base64: str = Field(description="The log's bytes in base64.")


class IngestIn(_In):
    """GPU runs' logs to read into calibration records (``headroom calibrate ingest``)."""

    model: ModelInput | None = Field(
        default=None, description=_MODEL + " The run's (not for published: true)."
    )
    train: TrainInput = Field(default=None, description=_TRAIN)
    gpu: GpuInput = Field(default="H100-80GB", description=_GPU)
    format: Literal[LOG_FORMATS] | None = Field(  # type: ignore[valid-type]
        default=None, description="The logs' format (default: recognised from each content)."
    )
    stage: Literal["first", "last"] | None = Field(
        default=None, description="The pipeline stage whose rank logged (default: the heaviest)."
    )
    logs: list[LogText | LogBase64] = Field(default_factory=list, max_length=64)
    published: StrictBool = Field(
        default=False,
        description="Also read the shipped published runs (calibration/data/published-memory"
        ".json), each as a record of the GPU it ran on.",
    )


class IngestOut(BaseModel):
    records: list[dict[str, Any]] = Field(description="One per log (or published run).")
    skipped: list[dict[str, str]] = Field(description="Published runs without a number.")
    trust: list[dict[str, Any]] = Field(
        description="The trust of each (GPU, framework, profile) the records belong to."
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="What the run's train (a stack's own config) did not map, or assumed.",
    )


class CalibrationOut(BaseModel):
    id: int
    uid: str
    created_at: dt.datetime
    source: str
    model_name: str
    gpu_name: str
    activation_profile: str
    framework: str
    measured_peak_bytes: int
    predicted_peak_bytes: int
    relative_error: float
    spec: dict[str, Any]
    measured: dict[str, Any]
    predicted: dict[str, Any]
    notes: str


class CoefficientSetOut(BaseModel):
    id: int | None = Field(description="None for the shipped defaults.")
    profile: str
    device: str | None
    calibrated: bool
    source: str
    values: dict[str, Any]
    created_at: dt.datetime | None = None
    active: bool = Field(default=True, description="The set calibrated estimates use.")
    trust: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per GPU and framework with records of this profile (this set's GPU where "
        "it has one): its recent records, trusted or not, the worst under-prediction and the "
        "margin, as estimate --calibrated judges them.",
    )


#: a run's own Slurm allocation: read by the route (``SlurmOverrides``), so that what its schema
#: cannot state (a time limit of at least a minute) is refused as the planner's rules are
SlurmInput = Annotated[dict[str, Any] | None, documented_as(SlurmOverrides | None)]


class RunIn(_In):
    uid: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=store.RUN_UID_PATTERN,
        description="Client-chosen id (the same request posted under it again returns the "
        "stored run, another request under it is a 409); it names the run's directory, so: "
        f"{store.RUN_UID_RULE}.",
    )
    model: ModelInput = Field(description=_MODEL)
    train: TrainInput = Field(default=None, description=_TRAIN)
    gpu: GpuInput = Field(default="H100-80GB", description=_GPU)
    steps: Annotated[int, NUMBER] = Field(default=10, ge=1, le=10_000_000)
    backend: Literal["local", "torchrun", "slurm"] = Field(
        default="local",
        description="How the trainer starts: a process beside the service (local, torchrun) or "
        "a Slurm batch job (slurm; the allocation from HEADROOM_SLURM_* and `slurm`).",
    )
    slurm: SlurmInput = Field(
        default=None,
        description="backend slurm: this run's allocation over the service's HEADROOM_SLURM_* "
        "settings (partition, account, time_limit, gpus_per_node, nodes).",
    )
    fit: StrictBool = Field(
        default=True,
        description="Let the auto-fit ladder choose the plan (otherwise the given spec must be "
        "predicted to fit).",
    )
    probe: StrictBool = Field(
        default=False,
        description="Confirm the plan with a probe into step 2 before launching (recorded as a "
        "calibration; steps down on out-of-memory).",
    )


class RunOut(BaseModel):
    id: int
    uid: str
    created_at: dt.datetime
    updated_at: dt.datetime
    status: str
    backend: str
    model_name: str
    gpu_name: str
    plan: dict[str, Any]
    steps: int
    device: str | None
    pid: int | None
    job_id: str | None = Field(description="The Slurm job it was submitted as (backend slurm).")
    exit_code: int | None
    reason: str
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


class Page(BaseModel):
    items: list[Any]
    total: int
