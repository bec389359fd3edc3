"""Planning routes: presets, this host's GPUs, estimate and gate. The planner does the work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from headroom import planner
from headroom.api.deps import MetricsDep
from headroom.api.metrics import Metrics
from headroom.api.problems import responses
from headroom.api.schemas import EstimateRequest, FitRequest, GateRequest
from headroom.launch.devices import local_gpus

router = APIRouter(tags=["planning"])


def _budget(body: EstimateRequest) -> planner.Budget:
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    return planner.estimate(model, train, hw)


@router.get("/presets")
def presets() -> dict[str, Any]:
    """GPU presets and bundled models."""
    return {
        "gpus": [planner.gpu(n).model_dump() for n in planner.gpu_names()],
        "models": [
            {"name": n, "params_total": planner.count_params(planner.load_model(n)).total}
            for n in planner.model_names()
        ],
    }


@router.get("/gpus")
def gpus() -> dict[str, Any]:
    """This host's GPUs through NVML, or an empty list and the reason."""
    return local_gpus()


# The hot path of the service, kept cheap (see docs/PERFORMANCE.md): ``async def`` with no
# sync dependency, so nothing goes through the thread pool (the estimate is ~100 µs of CPU), and
# the body is serialised once by the same model as ``response_model`` (which stays for the
# OpenAPI schema; FastAPI neither re-validates nor re-serialises a returned Response).
@router.post("/estimate", response_model=planner.BudgetModel, responses=responses(413, 422))
async def estimate(body: EstimateRequest, request: Request) -> Response:
    """Per-bucket GPU and host memory by phase, the peak and the verdict (a predicted OOM is a
    200 with ``fits: false``)."""
    budget = _budget(body)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("estimate").inc()
    metrics.verdicts.labels(str(budget.fits).lower()).inc()
    return Response(budget.model_dump_json(), media_type="application/json")


@router.post("/gate", response_model=planner.Verdict, responses=responses(413, 422))
def gate(body: GateRequest, metrics: MetricsDep) -> planner.Verdict:
    """Launch or not: ``fits``, ``oom`` or ``undecided`` with the exit code the CLI would use."""
    verdict = planner.gate(_budget(body), body.margin_pct, body.require_calibration)
    metrics.estimates.labels("gate").inc()
    metrics.verdicts.labels(str(verdict.fits).lower()).inc()
    return verdict


@router.post("/fit", response_model=planner.FitResult, responses=responses(413, 422))
def fit(body: FitRequest, metrics: MetricsDep) -> planner.FitResult:
    """The fastest ladder candidate (offload, micro-batch, recompute, ZeRO) that fits, the
    runners-up, and why others were rejected. Nothing fitting is a 200 with ``fits: false``."""
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    result = planner.fit(model, train, hw, margin_pct=body.margin_pct)
    metrics.estimates.labels("fit").inc(result.candidates_considered)
    metrics.verdicts.labels(str(result.fits).lower()).inc()
    return result
