"""Planning routes: presets, this host's GPUs, estimate, gate, fit and plan. The planner does
the work; the searches (fit, plan) queue for their thread (``Searches``)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

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
from headroom.api.settings import Settings
from headroom.launch.devices import local_gpus
from headroom.planner.cluster import cluster_and_gpu, cluster_names, cluster_preset
from headroom.planner.constraints import split_plan_train
from headroom.planner.layout import PlanBudget

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
_estimate_threads = anyio.CapacityLimiter(ESTIMATE_THREADS)
#: seconds between two looks at whether a search's client is still there
CLIENT_POLL_S = 0.05
#: what a /plan may cost the service (each counted before the work it stands for): its layouts
#: (the bundled models on 1,024 GPUs, the most the service plans, have up to 13,653; a body of
#: highly divisible sizes had 844,928) and candidates, refused (422) above these; the groups of
#: candidates its walk prices (~50-90 µs each: GPT-3 175B on 1,024 A100s finds its plan within
#: 12,000, its ten runners-up, each the best of a distinct layout, within 15,220, and walks
#: 16,520 to rule out the rest) and its estimates (Llama 3 70B on 32 H100s estimates 13,051
#: candidates to find ten other layouts that fit: here its plan and five runners-up), where
#: the walk stops (``truncated``). About a second of CPU at most (docs/PERFORMANCE.md);
#: ``headroom plan`` has ``planner.layout.PLAN_BUDGET``'s room.
SERVED_PLAN_BUDGET = PlanBudget(
    layouts=16_000, candidates=8_000_000, groups=12_000, estimates=5_000
)


async def _in_thread(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of ``limiter``'s (the others wait their turn)."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


class _Stopped(Exception):
    """A search stopped before its end (``outcome``: cancelled or deadline)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class Searches:
    """The service's /plan and /fit searches: ``SEARCH_THREADS`` at a time in threads of
    their own, at most ``waiting`` more queued (503 with Retry-After past them). A queued
    search whose client has gone is dropped unstarted; a running one stops (its ``check``,
    polled by the planner's loops, raises) when its client goes or after ``deadline_s``."""

    def __init__(self, *, waiting: int, deadline_s: float) -> None:
        self.threads = anyio.CapacityLimiter(SEARCH_THREADS)
        self.waiting = waiting
        self.deadline_s = deadline_s

    @property
    def retry_after_s(self) -> int:
        """When to ask again: the running search is done by then, at the latest."""
        return math.ceil(self.deadline_s)

    def _busy(self, detail: str) -> Response:
        retry = self.retry_after_s
        return problem(503, f"{detail}; retry in {retry} s", headers={"Retry-After": str(retry)})

    async def run(
        self, request: Request, endpoint: str, fn: Callable[[Callable[[], None]], T]
    ) -> T | Response:
        """``fn(check)`` in the search thread once its turn comes, or the problem that stopped
        it: the queue full (503), its client gone (499: no one reads it) or its deadline
        passed (503)."""
        metrics: Metrics = request.app.state.metrics
        outcomes = metrics.searches
        queued = self.threads.statistics()
        if queued.borrowed_tokens >= queued.total_tokens and queued.tasks_waiting >= self.waiting:
            outcomes.labels(endpoint, "queue_full").inc()
            return self._busy(f"{self.waiting} plan and fit searches wait already (search_queue)")
        metrics.searches_waiting.inc()
        try:
            await self.threads.acquire()
        finally:
            metrics.searches_waiting.dec()
        try:
            if await request.is_disconnected():
                outcomes.labels(endpoint, "client_gone").inc()
                return _client_left("before its search started")
            metrics.searches_running.inc()
            try:
                result, failure = await self._watched(request, fn)
            finally:
                metrics.searches_running.dec()
        finally:
            self.threads.release()
        if isinstance(failure, _Stopped):
            outcomes.labels(endpoint, failure.outcome).inc()
            if failure.outcome == "cancelled":
                return _client_left("while its search ran")
            return self._busy(
                f"the search ran past its deadline of {self.deadline_s:g} s (search_deadline_s): "
                "the service is busy"
            )
        if failure is not None:
            if isinstance(failure, planner.HeadroomError):
                outcomes.labels(endpoint, "invalid").inc()
            raise failure
        outcomes.labels(endpoint, "done").inc()
        return cast(T, result)

    async def _watched(
        self, request: Request, fn: Callable[[Callable[[], None]], T]
    ) -> tuple[T | None, Exception | None]:
        """``fn(check)`` in a thread while its client is watched: ``check`` raises ``_Stopped``
        once the client has gone or the deadline has passed. (its result, what it raised)."""
        gone = threading.Event()
        deadline = time.monotonic() + self.deadline_s

        def check() -> None:
            if gone.is_set():
                raise _Stopped("cancelled")
            if time.monotonic() > deadline:
                raise _Stopped("deadline")

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(CLIENT_POLL_S)
            gone.set()

        result: T | None = None
        failure: Exception | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch)
            try:
                # a thread of the default pool: the search limiter is this search's already
                result = await anyio.to_thread.run_sync(fn, check)
            except Exception as exc:  # returned: the group would wrap it in an ExceptionGroup
                failure = exc
            finally:
                tasks.cancel_scope.cancel()
        return result, failure


def _client_left(when: str) -> Response:
    # nginx's 499: no one reads it, but the request metrics and logs tell it apart
    return problem(499, f"the client left {when}", title="Client closed request")


def _searches(request: Request) -> Searches:
    """The app's searches (made on first use, from its settings)."""
    found: Searches | None = getattr(request.app.state, "searches", None)
    if found is None:
        settings: Settings = request.app.state.settings
        found = request.app.state.searches = Searches(
            waiting=settings.search_queue, deadline_s=settings.search_deadline_s
        )
    return found


def _specs(
    body: PlanningRequest,
) -> tuple[planner.ModelSpec, planner.TrainSpec, planner.Hardware]:
    """The body's model, training spec and GPU (its host memory and GPUs per node), validated."""
    model = planner.load_model(body.model)
    train = planner.load_train(body.train_of(model) or {})
    hw = planner.load_hardware(
        body.gpu, host_memory=body.host_memory, gpus_per_node=body.gpus_per_node
    )
    return model, train, hw


def _cluster(
    cluster: str | planner.Cluster | None, hw: planner.Hardware | None, gpus_per_node: int | None
) -> tuple[planner.Cluster, planner.Hardware]:
    """The cluster a body names (a preset's name or its fields), else the GPU's preset, and
    its GPU (``cluster_and_gpu``)."""
    given = cluster_preset(cluster) if isinstance(cluster, str) else cluster
    return cluster_and_gpu(given, hw, gpus_per_node)


def _budget(body: PlanningRequest) -> planner.Budget:
    model, train, hw = _specs(body)
    budget = planner.estimate(model, train, hw)
    budget.warnings.extend(body.train_warnings())
    return budget


async def _estimated(body: PlanningRequest) -> planner.Budget:
    """The budget: on the event loop for a preset model (microseconds, its terms cached), in an
    estimate thread for a model the body brings (parsed and worked out afresh: up to
    milliseconds)."""
    if isinstance(body.model, str):
        return _budget(body)
    return await _in_thread(_estimate_threads, _budget, body)


@router.get("/presets")
def presets() -> dict[str, Any]:
    """GPU presets, cluster presets (the nodes a plan runs on), bundled models and run presets
    (training specs projects ship)."""
    return {
        "runs": [planner.load_run(n).model_dump() for n in planner.run_names()],
        "gpus": [planner.gpu(n).model_dump() for n in planner.gpu_names()],
        "clusters": [cluster_preset(n).model_dump(exclude={"gpu_spec"}) for n in cluster_names()],
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
    if body.compare or body.step:
        extra: dict[str, Any] = {}
        if body.compare:
            extra["compare"] = await _in_thread(_estimate_threads, _compared, body)
        if body.step:
            extra["step"] = await _in_thread(_estimate_threads, _stepped, body)
        text = json.dumps({**budget.model_dump(), **extra})
        return Response(text, media_type="application/json")
    return Response(budget.model_dump_json(), media_type="application/json")


def _stepped(body: EstimateRequest) -> dict[str, Any]:
    """``planner.price_spec`` of the body's spec as given, as JSON values."""
    model, train, hw = _specs(body)
    cl, hardware = _cluster(body.cluster, hw, body.gpus_per_node)
    return planner.price_spec(model, train, cl, hardware).model_dump()


def _compared(body: PlanningRequest) -> list[dict[str, Any]]:
    """``planner.compare`` of the body's configuration, as JSON values."""
    model, train, hw = _specs(body)
    return [c.model_dump() for c in planner.compare(model, train, hw)]


@router.post("/gate", response_model=planner.Verdict, responses=responses(413, 422))
async def gate(body: GateRequest, request: Request) -> planner.Verdict:
    """Launch or not: ``fits``, ``oom`` or ``undecided`` with the exit code the CLI would use."""
    verdict = planner.gate(await _estimated(body), body.margin_pct, body.require_calibration)
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("gate").inc()
    metrics.verdicts.labels(str(verdict.fits).lower()).inc()
    return verdict


def _fit(body: FitRequest, check: Callable[[], None]) -> tuple[planner.FitResult, str]:
    """The search and its JSON (both in the search thread: the loop only sends it)."""
    model, train, hw = _specs(body)
    result = planner.fit(model, train, hw, margin_pct=body.margin_pct, check=check)
    if result.budget is not None:
        result.budget.warnings.extend(body.train_warnings())
    return result, result.model_dump_json()


@router.post("/fit", response_model=planner.FitResult, responses=responses(413, 422, 503))
async def fit(body: FitRequest, request: Request) -> Response:
    """The fastest ladder candidate (offload, micro-batch, recompute, ZeRO) that fits, the
    runners-up, and why others were rejected. Nothing fitting is a 200 with ``fits: false``.
    A 503 with Retry-After when too many searches wait already or this one ran past its
    deadline (the service's ``search_queue`` and ``search_deadline_s``)."""
    answer = await _searches(request).run(request, "fit", lambda check: _fit(body, check))
    if isinstance(answer, Response):
        return answer
    result, content = answer
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("fit").inc(result.candidates_considered)
    metrics.verdicts.labels(str(result.fits).lower()).inc()
    return Response(content, media_type="application/json")


def _plan(body: PlanRequest, check: Callable[[], None]) -> tuple[planner.PlanResult, str]:
    """The layout search within ``SERVED_PLAN_BUDGET`` and its JSON (in the search thread, as
    ``_fit``)."""
    model = planner.load_model(body.model)
    # the layout keys the train object names are the search's constraints
    train, constraints = split_plan_train(body.train_of(model))
    hw = planner.load_hardware(body.gpu) if body.gpu is not None else None
    cl, hardware = _cluster(body.cluster, hw, body.gpus_per_node)
    result = planner.plan(
        model,
        train,
        cl,
        hardware,
        body.gpus,
        body.global_batch,
        body.seq_len,
        margin_pct=body.margin_pct,
        budget=SERVED_PLAN_BUDGET,
        check=check,
        constraints=constraints,
        tie_band_pct=body.tie_band_pct,
    )
    if result.budget is not None:
        result.budget.warnings.extend(body.train_warnings())
    return result, result.model_dump_json()


@router.post("/plan", response_model=planner.PlanResult, responses=responses(413, 422, 503))
async def plan(body: PlanRequest, request: Request) -> Response:
    """The fastest parallel layout (TP, PP with its schedule, CP, DP, EP, ZeRO, micro-batch,
    recompute, offload) of at most ``gpus`` GPUs whose heaviest rank fits, ranked by predicted
    step time, with the runners-up and why the rest were rejected. Nothing fitting is a 200 with
    ``fits: false``. A search larger than the service plans (its layouts and candidates,
    counted before any is made) is a 422 naming what narrows it; a 503 with Retry-After when
    too many searches wait already or this one ran past its deadline."""
    answer = await _searches(request).run(request, "plan", lambda check: _plan(body, check))
    if isinstance(answer, Response):
        return answer
    result, content = answer
    metrics: Metrics = request.app.state.metrics
    metrics.estimates.labels("plan").inc(result.candidates_estimated)
    metrics.verdicts.labels(str(result.fits).lower()).inc()
    return Response(content, media_type="application/json")
