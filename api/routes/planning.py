"""Planning routes: presets, this host's GPUs, estimate and gate. The planner does the work."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

from headroom import planner
from headroom.api.metrics import Metrics
from headroom.api.problems import problem, responses
from headroom.api.schemas import (
    EstimateRequest,
    EstimateResponse,
    FitRequest,
    GateRequest,
    PlanningRequest,
    PlanRequest,
)
from headroom.launch.devices import local_gpus
from headroom.planner.cluster import cluster_and_gpu, cluster_preset

T = TypeVar("T")

#: the largest body a planning route reads: what its schema can hold (a model's 4,000-character
#: source and 256 dense layers, a GPU's source and aliases, a config.json's other keys) with
#: room to spare. JSON costs the event loop ~30 ms per MiB to read: bodies of 1 MiB of junk
#: from four clients slowed every other request to a crawl.
PLANNING_BODY_BYTES = 128 << 10


class _SmallBodies(APIRoute):
    """A route that refuses a body over ``PLANNING_BODY_BYTES`` (413) before reading it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            if request.method == "POST":
                length = request.headers.get("content-length")
                if length is None:  # streamed: read here, within the service's BodyLimit
                    size = len(await request.body())
                else:
                    size = int(length) if length.isdigit() else PLANNING_BODY_BYTES + 1
                if size > PLANNING_BODY_BYTES:
                    detail = f"request body is larger than {PLANNING_BODY_BYTES} bytes"
                    return problem(413, detail)
            return await handler(request)

        return limited


router = APIRouter(tags=["planning"], route_class=_SmallBodies)


# The planner's work on what a body brings runs in threads, so the event loop stays free for
# health checks and preset estimates: searches in one, custom models' estimates in another
# (milliseconds each, so they do not queue behind a search). Searches wait for each other:
# with the GIL more threads would not finish sooner, and each thread that computes makes the
# loop (and every other thread) wait longer for its turn (docs/PERFORMANCE.md).
SEARCH_THREADS = 1
ESTIMATE_THREADS = 1
_search_threads = anyio.CapacityLimiter(SEARCH_THREADS)
_estimate_threads = anyio.CapacityLimiter(ESTIMATE_THREADS)


async def _in_thread(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of ``limiter``'s (the others wait their turn)."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


def _budget(body: PlanningRequest) -> planner.Budget:
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    return planner.estimate(model, train, hw)


async def _estimated(body: PlanningRequest) -> planner.Budget:
    """The budget: on the event loop for a preset model (microseconds, its terms cached), in an
    estimate thread for a model the body brings (parsed and worked out afresh: up to
    milliseconds)."""
    if isinstance(body.model, str):
        return _budget(body)
    return await _in_thread(_estimate_threads, _budget, body)


@router.get("/presets")
def presets() -> dict[str, Any]:
    """GPU presets, bundled models and run presets (training specs projects ship)."""
    return {
        "runs": [planner.load_run(n).model_dump() for n in planner.run_names()],
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
# sync dependency, so a preset's estimate goes through no thread pool (~100 µs of CPU), and
# the body is serialised once by the same model as ``response_model`` (which stays for the
# OpenAPI schema; FastAPI neither re-validates nor re-serialises a returned Response).
@router.post("/estimate", response_model=EstimateResponse, responses=responses(413, 422))
async def estimate(body: EstimateRequest, request: Request) -> Response:
    """Per-bucket GPU and host memory by phase, the peak and the verdict (a predicted OOM is a
    200 with ``fits: false``); with ``compare``, the same configuration under every framework
    and activation profile too."""
    budget = await _estimated(body)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("estimate").inc()
    metrics.verdicts.labels(str(budget.fits).lower()).inc()
    if body.compare:
        compared = await _in_thread(_estimate_threads, _compared, body)
        text = json.dumps({**budget.model_dump(), "compare": compared})
        return Response(text, media_type="application/json")
    return Response(budget.model_dump_json(), media_type="application/json")


def _compared(body: PlanningRequest) -> list[dict[str, Any]]:
    """``planner.compare`` of the body's configuration, as JSON values."""
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    return [c.model_dump() for c in planner.compare(model, train, hw)]


@router.post("/gate", response_model=planner.Verdict, responses=responses(413, 422))
async def gate(body: GateRequest, request: Request) -> planner.Verdict:
    """Launch or not: ``fits``, ``oom`` or ``undecided`` with the exit code the CLI would use."""
    verdict = planner.gate(await _estimated(body), body.margin_pct, body.require_calibration)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("gate").inc()
    metrics.verdicts.labels(str(verdict.fits).lower()).inc()
    return verdict


def _fit(body: FitRequest) -> tuple[planner.FitResult, str]:
    """The search and its JSON (both in the search thread: the loop only sends it)."""
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    result = planner.fit(model, train, hw, margin_pct=body.margin_pct)
    return result, result.model_dump_json()


@router.post("/fit", response_model=planner.FitResult, responses=responses(413, 422))
async def fit(body: FitRequest, request: Request) -> Response:
    """The fastest ladder candidate (offload, micro-batch, recompute, ZeRO) that fits, the
    runners-up, and why others were rejected. Nothing fitting is a 200 with ``fits: false``."""
    result, content = await _in_thread(_search_threads, _fit, body)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("fit").inc(result.candidates_considered)
    metrics.verdicts.labels(str(result.fits).lower()).inc()
    return Response(content, media_type="application/json")


def _plan(body: PlanRequest) -> tuple[planner.PlanResult, str]:
    """The layout search and its JSON (in the search thread, as ``_fit``)."""
    model = planner.load_model(body.model)
    train = planner.load_train(body.train or {})
    hw = planner.load_hardware(body.gpu) if body.gpu is not None else None
    given = cluster_preset(body.cluster) if isinstance(body.cluster, str) else body.cluster
    cl, hardware = cluster_and_gpu(given, hw, body.gpus_per_node)
    result = planner.plan(
        model,
        train,
        cl,
        hardware,
        body.gpus,
        body.global_batch,
        body.seq_len,
        margin_pct=body.margin_pct,
    )
    return result, result.model_dump_json()


@router.post("/plan", response_model=planner.PlanResult, responses=responses(413, 422))
async def plan(body: PlanRequest, request: Request) -> Response:
    """The fastest parallel layout (TP, PP with its schedule, CP, DP, EP, ZeRO, micro-batch,
    recompute, offload) of at most ``gpus`` GPUs whose heaviest rank fits, ranked by predicted
    step time, with the runners-up and why the rest were rejected. Nothing fitting is a 200 with
    ``fits: false``."""
    result, content = await _in_thread(_search_threads, _plan, body)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("plan").inc(result.candidates_estimated)
    metrics.verdicts.labels(str(result.fits).lower()).inc()
    return Response(content, media_type="application/json")
