"""The estimate's result: per-bucket bytes on the GPU and host, by phase, and the verdict.

``Budget.model_dump()`` is exactly the JSON that ``headroom estimate --format json`` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from headroom.planner.coefficients import Coefficients
    from headroom.planner.model import ModelSpec

#: GPU buckets, in the order of the bucket vocabulary (docs/ESTIMATOR.md)
GPU_BUCKETS: tuple[str, ...] = (
    "params",
    "grads",
    "master_params",
    "optimizer_states",
    "ema",
    "activations",
    "logits",
    "moe_dispatch",
    "transfer_buffers",
    "cuda_context",
    "allocator_overhead",
)

#: the buckets of a phase row: what the tensors allocate (``cuda_context`` and
#: ``allocator_overhead`` are added on top of their sum)
ROW_BUCKETS: tuple[str, ...] = GPU_BUCKETS[:9]

#: host buckets: the same names, for what lives in host RAM
HOST_BUCKETS: tuple[str, ...] = (
    "params",
    "grads",
    "master_params",
    "optimizer_states",
    "ema",
    "transfer_buffers",
)

#: phases of a training step, in time order; step 1 runs before optimizer state exists
PHASES: tuple[str, ...] = (
    "step1_forward",
    "step1_backward",
    "forward",
    "backward",
    "optimizer",
)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


_M = TypeVar("_M", bound=_Out)


class ModelSummary(_Out):
    name: str
    params_total: int
    params_active_per_token: int
    params_mtp_excluded: int


class PhaseBudget(_Out):
    total_bytes: int
    buckets: dict[str, int]


class GpuBudget(_Out):
    """The heaviest rank's GPU. Three figures of its peak, each as a run would report it:
    ``allocated_peak_bytes`` (``torch.cuda.max_memory_allocated``: the tensors),
    ``reserved_peak_bytes`` (``torch.cuda.max_memory_reserved``: what the caching allocator
    holds, ``allocator_overhead`` more) and ``peak_bytes`` (what ``nvidia-smi`` shows for the
    process: ``cuda_context`` more again), the one the verdict compares with the capacity."""

    name: str
    capacity_bytes: int
    peak_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    headroom_bytes: int
    buckets: dict[str, int]
    phases: dict[str, PhaseBudget]


class HostBudget(_Out):
    capacity_bytes: int | None
    peak_bytes: int
    headroom_bytes: int | None
    ranks_sharing: int
    buckets: dict[str, int]


class CoefficientsUsed(_Out):
    profile: str
    device: str | None
    calibrated: bool
    source: str
    margin_fraction: float
    trusted: bool | None = None
    observed_error: float | None = None
    recent_records: int = 0


class BudgetModel(_Out):
    """The estimate's JSON schema: ``Budget.model_dump()`` validates against it."""

    model: ModelSummary
    gpu: GpuBudget
    host: HostBudget
    peak_phase: str
    fits: bool
    stage: int
    margin_bytes: int
    coefficients: CoefficientsUsed
    warnings: list[str]


def construct(cls: type[_M], **fields: object) -> _M:
    """Build an output model from values the estimator computed itself, skipping validation.

    ``model_construct`` walks every field's defaults; the estimator supplies all fields with
    the right types, and building a Budget is most of an estimate's cost otherwise.
    """
    obj = cls.__new__(cls)
    setattr_ = object.__setattr__
    setattr_(obj, "__dict__", fields)
    setattr_(obj, "__pydantic_fields_set__", set(fields))
    setattr_(obj, "__pydantic_extra__", None)
    setattr_(obj, "__pydantic_private__", None)
    return obj


class Budget:
    """Where every byte goes on the heaviest rank, and whether it fits.

    The verdict (``fits``, ``peak_phase``, ``stage``, ``margin_bytes``, ``warnings``, the GPU and
    host peaks) is computed by the estimate. The per-phase, per-bucket views (``gpu``, ``host``,
    ``model``, ``coefficients``) are built from the same integers on first access, so a search
    that only reads the verdict does not pay for dictionaries it never looks at.
    ``model_dump()`` is exactly the JSON of ``headroom estimate --format json`` and validates
    against :class:`BudgetModel`. The estimator passes its arguments by position: a search
    builds one per candidate, and seventeen keyword arguments cost half a microsecond more.
    """

    __slots__ = (
        "_allocator_overhead_fraction",
        "_capacity",
        "_coeffs",
        "_context",
        "_full",
        "_hardware_name",
        "_host",
        "_host_capacity",
        "_model",
        "_ranks",
        "_rows",
        "fits",
        "gpu_peak_bytes",
        "host_peak_bytes",
        "margin_bytes",
        "peak_phase",
        "stage",
        "warnings",
    )

    def __init__(
        self,
        peak_phase: str,
        fits: bool,
        stage: int,
        margin_bytes: int,
        warnings: list[str],
        gpu_peak_bytes: int,
        host_peak_bytes: int,
        model: ModelSpec,
        hardware_name: str,
        capacity: int,
        rows: Callable[[], Sequence[Sequence[int]]],
        context: int,
        allocator_overhead_fraction: float,
        host: Sequence[int],
        ranks: int,
        host_capacity: int | None,
        coeffs: Coefficients,
    ) -> None:
        self.peak_phase = peak_phase
        self.fits = fits
        self.stage = stage
        self.margin_bytes = margin_bytes
        self.warnings = warnings
        self.gpu_peak_bytes = gpu_peak_bytes
        self.host_peak_bytes = host_peak_bytes
        self._model = model
        self._hardware_name = hardware_name
        self._capacity = capacity
        self._rows = rows
        self._context = context
        self._allocator_overhead_fraction = allocator_overhead_fraction
        self._host = host
        self._ranks = ranks
        self._host_capacity = host_capacity
        self._coeffs = coeffs
        self._full: BudgetModel | None = None

    def _build(self) -> BudgetModel:
        from headroom.planner.buckets import allocator_overhead_bytes
        from headroom.planner.params import count_params

        full = self._full
        if full is not None:
            return full
        phases = {}
        for name, row in zip(PHASES, self._rows(), strict=True):
            allocated = sum(row)
            buckets = dict(zip(ROW_BUCKETS, row, strict=True))
            buckets["cuda_context"] = self._context
            buckets["allocator_overhead"] = allocator_overhead_bytes(
                allocated, self._allocator_overhead_fraction
            )
            phases[name] = construct(
                PhaseBudget, total_bytes=sum(buckets.values()), buckets=buckets
            )
        host_buckets = {
            name: v * self._ranks for name, v in zip(HOST_BUCKETS, self._host, strict=True)
        }
        counts = count_params(self._model)
        coeffs = self._coeffs
        cap, host_cap = self._capacity, self._host_capacity
        full = construct(
            BudgetModel,
            model=construct(
                ModelSummary,
                name=self._model.name,
                params_total=counts.total,
                params_active_per_token=counts.per_token_active,
                params_mtp_excluded=counts.mtp_excluded,
            ),
            gpu=construct(
                GpuBudget,
                name=self._hardware_name,
                capacity_bytes=cap,
                peak_bytes=self.gpu_peak_bytes,
                allocated_peak_bytes=self.gpu_peak_bytes
                - self._context
                - phases[self.peak_phase].buckets["allocator_overhead"],
                reserved_peak_bytes=self.gpu_peak_bytes - self._context,
                headroom_bytes=cap - self.gpu_peak_bytes,
                buckets=phases[self.peak_phase].buckets,
                phases=phases,
            ),
            host=construct(
                HostBudget,
                capacity_bytes=host_cap,
                peak_bytes=self.host_peak_bytes,
                headroom_bytes=None if host_cap is None else host_cap - self.host_peak_bytes,
                ranks_sharing=self._ranks,
                buckets=host_buckets,
            ),
            peak_phase=self.peak_phase,
            fits=self.fits,
            stage=self.stage,
            margin_bytes=self.margin_bytes,
            coefficients=construct(
                CoefficientsUsed,
                profile=coeffs.profile,
                device=coeffs.device,
                calibrated=coeffs.calibrated,
                source=coeffs.source,
                margin_fraction=coeffs.margin_fraction,
                trusted=coeffs.trusted,
                observed_error=coeffs.observed_error,
                recent_records=coeffs.recent_records,
            ),
            warnings=list(self.warnings),
        )
        self._full = full
        return full

    @property
    def gpu(self) -> GpuBudget:
        return self._build().gpu

    @property
    def host(self) -> HostBudget:
        return self._build().host

    @property
    def model(self) -> ModelSummary:
        return self._build().model

    @property
    def coefficients(self) -> CoefficientsUsed:
        return self._build().coefficients

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The estimate as plain data (keyword arguments as pydantic's ``model_dump``)."""
        return self._build().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        """The estimate as JSON (keyword arguments as pydantic's ``model_dump_json``)."""
        return self._build().model_dump_json(**kwargs)

    def __repr__(self) -> str:
        return (
            f"Budget(fits={self.fits}, peak_phase={self.peak_phase!r}, stage={self.stage}, "
            f"gpu_peak_bytes={self.gpu_peak_bytes}, host_peak_bytes={self.host_peak_bytes})"
        )
