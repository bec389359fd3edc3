"""Plan the cluster: the fastest parallel layout of N GPUs whose heaviest rank fits.

A layout is TP x PP (1F1B, or interleaved with ``vpp`` virtual stages) x CP x DP GPUs, EP
carved from DP x CP, with the per-rank ladder inside it (ZeRO stage, offload placement,
micro-batch with gradient accumulation keeping the global batch, recompute, the allocator's
expandable segments). Ranks are numbered as Megatron-Core numbers them (``tp-cp-ep-dp-pp``: TP
fastest), so a group's members sit ``stride`` ranks apart and a node of ``G`` GPUs holds
``G / stride`` of them; TP stays inside a node.

**Step time** (``StepTerms``, per optimizer step of the first pipeline stage's rank; every term
is named and ``explain_step`` gives its formula):

- ``compute``: the ``StepModel``'s FLOPs (6 per active parameter per token, causal attention,
  one more forward under recompute, the matmuls it does not keep under torchtitan's per-op
  policy) of the rank's tokens (micro-batch x sequence / CP x
  micro-batches) over TP x PP, at the GPU's bf16 FLOP/s x the coefficients'
  ``compute_efficiency``.
- ``tp_comm``: per layer and pass (forward, backward, and the recompute's forward), two
  all-reduces of the layer's activations (with sequence parallelism two all-gathers and two
  reduce-scatters: the same bytes), not overlapped; torchtitan's per-op policy keeps the
  reduce-scatters' outputs, so its recompute gathers again only (half a pass).
- ``ep_comm``: per MoE layer and pass, two all-to-alls (dispatch, combine) of the routed
  tokens' hidden states, not overlapped.
- ``cp_comm``: per layer and pass, the ring's K/V exchange (backward: K/V and their
  gradients), less the attention it overlaps.
- ``pp_comm``: per micro-batch, each of the rank's ``vpp`` chunks sends its output forward and
  its input's gradient back.
- ``bubble``: the schedule's fill and drain (``planner.schedules.bubble_micro_batches``):
  ``pp - 1`` micro-batch times under 1F1B and GPipe, ``(pp - 1) / vpp`` interleaved
  (Narayanan et al. 2021, eq. 1 and 2), a third of that under the interleaved zero-bubble
  schedule, ``(pp - 1) / 6`` under the V schedules (more under ZB-V with fewer than
  ``3 pp / 2`` micro-batches).
- ``dp_comm``: gradient reduction over DP x CP (all-reduce at ZeRO 0, reduce-scatter at 1-2,
  with the updated parameters all-gathered after the step), less the last micro-batch's
  backward it overlaps (and the parameters' gather less the first forward); ZeRO 3 gathers the
  parameters for each micro-batch's forward and backward and reduce-scatters its gradients,
  less that micro-batch's compute. Expert gradients reduce over DP x CP / EP.
- ``offload_transfer``, ``cpu_optimizer``: the host link and the CPU step of optimizer
  offload or streaming, overlapped as the ``StepModel`` overlaps them.
- ``gpu_optimizer``: the optimizer step's memory traffic over the GPU's memory bandwidth.
- ``host_bound``: what a micro-batch waits on the host beyond its GPU work. A micro-batch
  takes at least ``layers x passes`` times a least time per layer-pass
  (``host_layer_floor``): the coefficients' ``tp_host_layer_seconds`` under TP (the eager
  dispatch of a layer's kernels and collectives) and, where the pipeline's stages sit on
  different nodes, ``pp_cross_node_layer_seconds + pp_cross_node_layer_seconds_per_tp x tp``.
  Both are 0 unless measured for the stack; nanotron's are fitted to the Ultra-Scale
  Playbook's sweep (``calibration/sweep.py``), where they separate layouts of one node's
  FLOPs by up to 5x.

A collective over ``n`` ranks, ``m`` of them in a node and ``k = n / m`` nodes, runs
hierarchically (NCCL's rings and trees): the intra-node part at the cluster's intra-node
bandwidth, the inter-node part on ``1/m`` of the bytes at each GPU's network share, each at
its achieved efficiency, plus a latency per step.

**Search**: every layout of at most N GPUs (whole nodes, or part of one node) whose degrees
divide the model and the global batch, valid for the framework that runs it (below), every
per-rank choice inside it. The layout keys the training spec names (``PlanConstraints``:
``parallel.tp`` ... ``expandable_segments``) narrow it to their values; a constraint no layout
can meet is refused naming its key. The ZeRO stages are the framework's (``FRAMEWORK_RULES``:
fsdp2 3, deepspeed 1-3, megatron 0, none 0-3) unless ``parallel.zero_stage`` is given. Each
candidate is priced (a few arithmetic operations: a layout's per-byte costs are resolved once).
Layouts are taken in the order of their ``floor`` (what every candidate of the layout pays at
least: its FLOPs and memory-bound traffic over its GPUs, and the communication every token
pays), in batches: a batch's candidates are walked fastest first and estimated
(``planner.estimate``'s own terms, memoised by their inputs) until they are slower than the
runners-up found, and once a batch's least floor is slower than the last runner-up, no later
layout can place and none is priced. A (layout, ZeRO stage, placement) whose optimizer phase
alone (persistent state, gradients and the step's temporaries: a lower bound of its peak)
exceeds the GPU is rejected without pricing its candidates.

The runners-up are the fastest candidate of each other layout (its degrees and ZeRO stage): a
candidate of a layout listed already (another offload fraction, micro-batch or recompute) is
skipped unestimated.

**Rules** (what each stack runs): TP inside a node, dividing the attention and KV heads and
the FFN widths it shards, and with sequence parallelism each CP rank's sequence; PP of at least
a layer per stage, the earlier stages taking the remainder, except under Megatron, which
divides the layers evenly without first/last stage sizes; ``vpp`` dividing each stage's layers
into equal chunks, and only with a micro-batch count the pipeline divides (Megatron-Core's
interleaved schedule refuses others), none under DeepSpeed (1F1B only); CP cutting each
sequence into 2 x cp chunks (load-balanced ring attention), none under MLA; EP dividing the
experts and dp x cp; DeepSpeed's pipeline at ZeRO stage 1 at most.

**Budget** (``PlanBudget``): before any layout is made, the layouts and candidates are counted
from the degrees' divisor sets (``Planner.size``), and a search over more than the budget's is
refused naming what narrows it; the walk counts each batch's groups of candidates before
pricing them and stops (``truncated``) before it would pass the budget's, or at its estimates.
A search's ``check`` (a deadline, a client that went away) is called between its steps.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from pydantic import BaseModel, Field

from headroom.planner.budget import BudgetModel
from headroom.planner.cluster import Cluster
from headroom.planner.coefficients import Coefficients, default_coefficients
from headroom.planner.constraints import PlanConstraints
from headroom.planner.errors import SpecError
from headroom.planner.estimator import (
    FRAMEWORK_RULES,
    Knobs,
    check_interleaving,
    check_selective_op,
    end_stages,
    estimate,
    gpu_peak,
    knobs,
    overheads,
    selective_op_offered,
    stages_states,
)
from headroom.planner.hardware import Hardware, compute_efficiency
from headroom.planner.losses import WHOLE_VOCAB_IMPLS
from headroom.planner.model import ModelSpec
from headroom.planner.params import count_params
from headroom.planner.schedules import (
    BY_COUNT,
    SINGLE_STAGE,
    V_SHAPED,
    bubble_micro_batches,
    micro_batch_rule,
    schedule_of,
)
from headroom.planner.stage import check_layout, stage_params
from headroom.planner.steptime import StepModel, streaming_step_seconds
from headroom.planner.train import Loss, Recompute, RecomputePolicy, TrainSpec
from headroom.planner.units import over_gpu, over_host

#: most GPUs a plan is asked about (the search walks every world size up to it)
MAX_PLAN_GPUS = 16384
#: layouts priced together before the search looks at the floors again
PLAN_LAYOUTS_PER_BATCH = 64
#: most candidates one plan estimates (each ~10-40 µs): bounds a search where so many of the
#: fastest candidates do not fit
PLAN_MAX_ESTIMATES = 100_000
#: why layouts were refused: the first few reasons a plan lists
MAX_LAYOUT_REJECTIONS = 10
#: layouts whose floor is worked out between two calls of a search's ``check`` (which is also
#: called before each batch of layouts is priced and each candidate estimated)
CHECK_EVERY = 1024


class PlanBudget(NamedTuple):
    """What one plan's search may cost. The first two are counted from the divisor sets before
    any layout is made, and a search over them is refused (a ``SpecError`` naming what narrows
    it); the walk stops at the last two (``PlanResult.truncated``)."""

    layouts: int
    """Most layouts (each's costs and floor are worked out, ~25 µs)."""
    candidates: int
    """Most candidates of all the layouts together (what the walk prices if no floor skips
    a layout)."""
    groups: int
    """Most groups of candidates the walk prices (a layout's candidates of one ZeRO stage,
    placement and accumulation share their model states: ~50 µs a group, a few µs a
    candidate); it stops before a batch of layouts that would pass it."""
    estimates: int
    """Most candidates the walk estimates (~10-40 µs each)."""


#: ``headroom plan``'s budget: room for the largest clusters it plans (Llama 3.1 405B or
#: Qwen3 235B on 16,384 GPUs: 20,556 and 67,110 layouts)
PLAN_BUDGET = PlanBudget(
    layouts=100_000, candidates=50_000_000, groups=10**9, estimates=PLAN_MAX_ESTIMATES
)
#: optimizer-offload fractions the plan tries (the ladder refines within a layout)
PLAN_OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
#: streaming: layers per checkpointed block
PLAN_STREAMING_EVERY = (1, 2, 4)
#: largest micro-batch proposed
PLAN_MAX_MICRO_BATCH = 256
#: largest number of virtual pipeline stages per rank proposed
PLAN_MAX_VPP = 8
#: recompute policies, cheapest in memory last: (spec value, selective, layers per block);
#: torchtitan's per-op policy is proposed to its profile only, without context parallelism
#: (``Planner.recomputes``)
RECOMPUTE: tuple[tuple[RecomputePolicy, bool, int | None], ...] = (
    ("none", False, None),
    ("selective", True, None),
    ("selective_op", False, None),
    ("full", False, 1),
)
#: ``RECOMPUTE``'s index of torchtitan's per-op policy
SELECTIVE_OP = 2
#: passes of the tensor-parallel collectives under it: forward, backward and the recompute's
#: all-gathers (the policy keeps the reduce-scatters' outputs), half a pass of the pairs
SELECTIVE_OP_TP_PASSES = 2.5
#: steps within this % of the fastest are equally fast: the plan takes the roomiest of them (the
#: step model's held-out errors on published runs are a few % at best)
TIE_BAND_PCT = 2.0
#: a plan whose GPU peak is within this % of the GPU's memory is flagged
NEAR_CAPACITY_PCT = 3.0


class Layout(NamedTuple):
    """A parallel layout: the degrees of each axis (``world`` = tp x pp x cp x dp)."""

    world: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int


class StepTerms(NamedTuple):
    """A candidate's predicted step, term by term (seconds; see the module docstring)."""

    compute: float
    bubble: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    pp_comm: float
    dp_comm: float
    offload_transfer: float
    cpu_optimizer: float
    gpu_optimizer: float
    host_bound: float
    step: float


def group_shape(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(members per node, nodes) of a group of ``size`` ranks ``stride`` apart."""
    if size <= 1:
        return 1, 1
    if stride >= gpus_per_node:
        return 1, size
    per_node = min(size, max(1, gpus_per_node // stride))
    return per_node, -(-size // per_node)


def pipeline_crosses_nodes(lay: Layout, gpus_per_node: int) -> bool:
    """Whether a layout's pipeline stages sit on different nodes (PP is the slowest-varying
    rank, ``world / pp`` ranks apart)."""
    return lay.pp > 1 and group_shape(lay.pp, lay.world // lay.pp, gpus_per_node)[1] > 1


def host_layer_floor(coeffs: Coefficients, lay: Layout, gpus_per_node: int) -> float:
    """A micro-batch's least seconds per layer and pass on a layout: the coefficients'
    ``tp_host_layer_seconds`` under TP > 1 and, where the pipeline crosses nodes,
    ``pp_cross_node_layer_seconds + pp_cross_node_layer_seconds_per_tp x tp`` if larger (0
    for a stack none was measured for)."""
    floor = coeffs.tp_host_layer_seconds if lay.tp > 1 else 0.0
    if pipeline_crosses_nodes(lay, gpus_per_node):
        cross = (
            coeffs.pp_cross_node_layer_seconds + coeffs.pp_cross_node_layer_seconds_per_tp * lay.tp
        )
        floor = max(floor, cross)
    return floor


class Links(NamedTuple):
    """A cluster's achieved bandwidths (bytes/s) and latencies (s)."""

    intra: float
    inter: float
    intra_latency: float
    inter_latency: float
    gpus_per_node: int


def links(cluster: Cluster, gpus_per_node: int) -> Links:
    return Links(
        cluster.intra_node_bytes_per_s * cluster.intra_node_efficiency,
        cluster.inter_node_bytes_per_s * cluster.inter_node_efficiency,
        cluster.intra_node_latency_s,
        cluster.inter_node_latency_s,
        gpus_per_node,
    )


def all_reduce_cost(size: int, stride: int, ln: Links) -> tuple[float, float]:
    """(seconds per byte, seconds) of an all-reduce over a group: ring reduce-scatter and
    all-gather inside each node, an all-reduce of each member's ``1/m`` across the nodes."""
    m, k = group_shape(size, stride, ln.gpus_per_node)
    per_byte = latency = 0.0
    if m > 1:
        per_byte += 2 * (m - 1) / m / ln.intra
        latency += 2 * (m - 1) * ln.intra_latency
    if k > 1:
        per_byte += 2 * (k - 1) / k / m / ln.inter
        latency += 2 * (k - 1) * ln.inter_latency
    return per_byte, latency


def all_to_all_cost(size: int, stride: int, ln: Links) -> tuple[float, float]:
    """(seconds per byte a rank holds, seconds) of an all-to-all: ``(m - 1)/n`` of the bytes to
    members of its node, ``(n - m)/n`` over the network, the two at once."""
    if size <= 1:
        return 0.0, 0.0
    m, _ = group_shape(size, stride, ln.gpus_per_node)
    intra = (m - 1) / size / ln.intra
    inter = (size - m) / size / ln.inter
    latency = (m - 1) * ln.intra_latency + (size - m) * ln.inter_latency
    return max(intra, inter), latency


def p2p_cost(stride: int, ln: Links) -> tuple[float, float]:
    """(seconds per byte, seconds) of a send to the rank ``stride`` away."""
    if stride < ln.gpus_per_node:
        return 1 / ln.intra, ln.intra_latency
    return 1 / ln.inter, ln.inter_latency


class _LayoutCosts(NamedTuple):
    """What pricing a candidate of one layout reads, resolved once per layout: seconds per
    micro-batch sequence (``*_b``) and seconds (``*_c``) of each term."""

    tp_b: float  # per layer-pass, x micro-batch
    tp_c: float
    ep_b: float
    ep_c: float
    cp_b: float  # comm less the attention it hides, per layer-pass, x micro-batch
    cp_c: float
    pp_b: float  # per chunk boundary crossing (each way)
    pp_c: float
    layers: int  # layers of the first stage
    moe_layers: int
    dense_numel: int  # the first stage's local parameters
    expert_numel: int
    dp_ar: tuple[float, float]  # dense gradients' group: all-reduce (per byte, seconds)
    edp_ar: tuple[float, float]  # expert gradients' group
    host_layer: float  # a micro-batch's least seconds per layer-pass (``host_layer_floor``)


class _Shape(NamedTuple):
    """Layouts sharing their world, TP, PP, CP and DP degrees: one per (vpp, ep) pair."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpps: tuple[int, ...]
    eps: tuple[int, ...]


class SearchSize(NamedTuple):
    """How many layouts and candidates a plan's search considers (``Planner.size``)."""

    layouts: int
    groups: int
    candidates: int


class _FloorCosts(NamedTuple):
    """``_LayoutCosts``' communication terms and the first stage's layers: what a layout's
    ``floor`` reads, without its parameters."""

    tp_b: float
    tp_c: float
    ep_b: float
    ep_c: float
    pp_b: float
    pp_c: float
    layers: int
    moe_layers: int


class Candidate(NamedTuple):
    """One priced candidate: its layout and per-rank choices."""

    step: float
    key: int
    layout: Layout
    zero: int
    placement: int
    micro_batch: int
    recompute: int
    segments: bool


class PlanCandidate(BaseModel):
    """A candidate in the spec's own terms, with what was predicted of it."""

    parallel: dict[str, Any] = Field(description="Its parallel degrees and ZeRO stage.")
    gpus_used: int
    micro_batch_size: int
    grad_accum_steps: int
    recompute: Any
    offload: dict[str, Any]
    expandable_segments: bool
    gpu_peak_bytes: int | None = None
    host_peak_bytes: int | None = None
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    plan: dict[str, Any] | None = Field(
        default=None, description="Its whole training spec (runners-up)."
    )
    reason: str | None = Field(default=None, description="Why it was rejected.")


class StepTerm(BaseModel):
    """One term of the predicted step, explained."""

    term: str
    seconds: float
    formula: str
    inputs: dict[str, Any]


class PlanResult(BaseModel):
    """The chosen layout, its budget and step, the runners-up and why the rest were rejected."""

    fits: bool
    plan: dict[str, Any] | None = Field(description="The chosen training spec, parallel filled.")
    budget: BudgetModel | None
    predicted_step_seconds: float | None
    predicted_tokens_per_second: float | None
    step: list[StepTerm] = Field(default_factory=list, description="The step's terms, explained.")
    gpus: int
    gpus_per_node: int
    gpus_used: int | None
    cluster: str
    gpu: str
    global_batch: int
    seq_len: int
    layouts_considered: int
    truncated: bool = Field(
        default=False,
        description="The walk stopped at its budget (the groups of candidates it may price, or "
        "the estimates: so many fast candidates did not fit) before it could rule out the "
        "layouts left: what it found is reported (the reason says where it stopped), faster "
        "fitting layouts may exist.",
    )
    layouts_skipped: int = Field(
        description="Layouts left unpriced: their floor (FLOPs, memory-bound traffic and the "
        "communication every token pays, over their GPUs) is slower than the last runner-up."
    )
    candidates_considered: int = Field(description="Candidates priced (every per-rank choice).")
    candidates_estimated: int = Field(
        description="Candidates whose memory was estimated (the fastest first, until the "
        "chosen one and the runners-up fitted); the rest are slower than the last runner-up."
    )
    runners_up: list[PlanCandidate]
    rejected: list[PlanCandidate] = Field(description="Rejected candidates (the first few).")
    rejected_total: int
    rejected_by_reason: dict[str, int] = Field(
        description="gpu_memory, host_memory, model_states (the optimizer phase alone exceeds "
        "the GPU: the layout's candidates unpriced), layout (degrees the model or batch cannot "
        "be split by: whole layouts)."
    )
    layout_rejections: list[str] = Field(description="Why layouts were refused (the first few).")
    margin_pct: float | None
    margin_pct_used: float = Field(
        default=0.0,
        description="The margin the verdicts added to each peak, % (margin_pct, or the "
        "coefficients' default: the worst under-prediction the published GPU runs showed).",
    )
    tie_band_pct: float = Field(
        default=0.0,
        description="Candidates within this % of the fastest step count as equally fast: the "
        "plan is the one of them with the most GPU headroom.",
    )
    near_capacity: bool = Field(
        default=False,
        description="The plan's GPU peak (margin left out) is within NEAR_CAPACITY_PCT % of "
        "the GPU's memory: a run may fail on what the estimate does not see (fragmentation, "
        "a larger batch of a data loader, another process).",
    )
    reason: str
    constraints: dict[str, Any] = Field(
        default_factory=dict,
        description="The layout keys the training spec named (parallel.tp, parallel.pp, "
        "parallel.vpp, parallel.cp, parallel.ep, parallel.dp, parallel.zero_stage, "
        "parallel.sequence_parallel, micro_batch_size, grad_accum_steps, recompute, "
        "offload.mode, offload.fraction, offload.checkpoint_every, expandable_segments): the "
        "search kept to their values and chose the rest.",
    )
    zero_stages: list[int] = Field(
        default_factory=list,
        description="The ZeRO stages searched: parallel.zero_stage if given, else the "
        "framework's (none: 0-3; fsdp2: 3, its full shard; deepspeed: 1-3, 1 under a "
        "pipeline; megatron: 0 with its distributed optimizer).",
    )
    zero_stages_reason: str = Field(default="", description="Why those ZeRO stages.")


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """``n``'s divisors, ascending (pairs up to its square root; kept: the search asks of the
    same world sizes, up to ``MAX_PLAN_GPUS``, thousands of times)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*low, *(n // d for d in reversed(low) if d * d != n))


def _micro_batches(per_rank: int) -> list[int]:
    """The micro-batches a rank of ``per_rank`` sequences per step tries."""
    return [mb for mb in _powers_of_two(min(per_rank, PLAN_MAX_MICRO_BATCH)) if per_rank % mb == 0]


def _unchecked() -> None:
    """A search's ``check`` when nothing may stop it."""


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def _offload_mode(want: PlanConstraints) -> str | None:
    """The offload mode the constraints ask for: ``offload.mode``, or the mode whose key they
    name (``offload.fraction``: optimizer, ``offload.checkpoint_every``: streaming)."""
    implied = {
        "offload.fraction": "optimizer" if want.offload_fraction is not None else None,
        "offload.checkpoint_every": (
            "streaming" if want.offload_checkpoint_every is not None else None
        ),
    }
    mode = want.offload_mode
    for key, needs in implied.items():
        if needs is None:
            continue
        if mode is not None and mode != needs:
            _refuse_key(key, f"applies to offload.mode {needs} only; got offload.mode {mode}")
        mode = needs
    return mode


def _refuse_key(key: str, why: str) -> NoReturn:
    """A constraint's refusal, naming its key as the training spec spells it."""
    raise SpecError(f"train.{key}: {why}", field=f"train.{key}")


def _loss_name(loss: Loss) -> str:
    """How a refusal names the loss: ``loss.impl X``, or ``loss.compiled`` with it."""
    return f"loss.impl {loss.impl}" + (" with loss.compiled" if loss.compiled else "")


def _some(values: list[int] | tuple[int, ...], limit: int = 16) -> str:
    """The first ``limit`` of ``values``, for a message."""
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")


def _wanted(degrees: tuple[int, ...], wanted: int | None) -> tuple[int, ...]:
    """``degrees``, or the constraint's degree alone if it is one of them (else none)."""
    if wanted is None:
        return degrees
    return (wanted,) if wanted in degrees else ()


def _spec_value(policy: RecomputePolicy) -> Any:
    """A recompute policy as the training spec spells it."""
    return policy.model_dump() if isinstance(policy, Recompute) else policy


#: why Megatron refuses a pipeline that does not divide the layers: megatron/training/
#: arguments.py (NVIDIA/Megatron-LM d98e8a64), when neither --decoder-first-pipeline-num-layers
#: nor --decoder-last-pipeline-num-layers is given (a training spec names neither):
#: ``assert num_layers % args.transformer_pipeline_model_parallel_size == 0, 'Number of layers
#: should be divisible by the pipeline-model-parallel size'``
_MEGATRON_PP = (
    "pp={pp}: Megatron splits num_layers ({layers}) evenly over the pipeline stages (without "
    "--decoder-first/last-pipeline-num-layers): pp must divide it"
)


class Planner:
    """One plan search: the model, training spec, cluster and coefficients resolved once."""

    def __init__(
        self,
        model: ModelSpec,
        train: TrainSpec,
        cluster: Cluster,
        hardware: Hardware,
        gpus: int,
        global_batch: int,
        seq_len: int,
        coefficients: Coefficients | None = None,
        margin_pct: float | None = None,
        budget: PlanBudget = PLAN_BUDGET,
        check: Callable[[], None] | None = None,
        constraints: PlanConstraints | None = None,
    ) -> None:
        """``budget`` bounds the search (``run``); ``check``, called between its steps, may
        raise to stop it (a deadline, a client that went away); ``constraints`` (the layout keys
        the training spec named) narrow it to the layouts and choices with their values, each
        refused up front (a ``SpecError`` naming its key) where no layout can meet it."""
        if not 1 <= gpus <= MAX_PLAN_GPUS:
            raise SpecError(
                f"gpus: must be between 1 and {MAX_PLAN_GPUS}, got {gpus}", field="gpus"
            )
        if global_batch < 1:
            raise SpecError(
                f"global_batch: must be at least 1 sequence, got {global_batch}",
                field="global_batch",
            )
        self.model, self.cluster, self.hw = model, cluster, hardware
        self.gpus, self.batch, self.seq = gpus, global_batch, seq_len
        want = self.want = constraints or PlanConstraints()
        rules = FRAMEWORK_RULES.get(train.framework)
        self.zero_stages = rules.zero_stages if rules is not None else (0, 1, 2, 3)
        self.zero_why = (
            rules.zero_why
            if rules is not None
            else "framework none runs ZeRO as parallel.zero_stage says (0-3)"
        )
        modes = rules.offload_modes if rules is not None else ("none", "optimizer", "streaming")
        if want.zero_stage is not None:
            self.zero_stages, self.zero_why = (want.zero_stage,), "parallel.zero_stage is given"
        mode = _offload_mode(want)
        if mode is not None:
            modes = (mode,)
        self.modes = modes
        # DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/engine.py) asserts
        # ``zero_optimization_stage() < ZeroStageEnum.gradients``: "ZeRO-2 and ZeRO-3 are
        # incompatible with pipeline parallelism"
        self.pipeline_zero_stages = tuple(
            z for z in self.zero_stages if train.framework != "deepspeed" or z < 2
        )
        # the spec each candidate's knobs are made from: the framework's first ZeRO stage (the
        # input's zero_stage is the plan's to choose, and fsdp2 or deepspeed refuse its default
        # 0) and the constraints' placement and recompute, so ``knobs`` refuses what the
        # framework does not run, naming the key
        update: dict[str, Any] = {
            "seq_len": seq_len,
            "parallel": train.parallel.model_copy(update={"zero_stage": self.zero_stages[0]}),
        }
        if mode is not None:
            update["offload"] = train.offload.model_copy(update={"mode": mode})
        if want.recompute is not None:
            update["recompute"] = want.recompute
        self.train = train.model_copy(update=update)
        # recompute policies by index: ``RECOMPUTE``, and a constraint's every-K block
        self.recompute_table: tuple[tuple[RecomputePolicy, bool, int | None], ...] = RECOMPUTE
        if isinstance(want.recompute, Recompute):
            self.recompute_table += ((want.recompute, False, want.recompute.every_k),)
        self.coeffs = coefficients or default_coefficients(train.activation_profile, hardware.name)
        self.margin_pct = margin_pct
        self.margin_fraction = (
            self.coeffs.margin_fraction if margin_pct is None else margin_pct / 100
        )
        self.base = knobs(self.train)
        self.links = links(cluster, hardware.gpus_per_node)
        self.price = StepModel(
            model, seq_len, 1, hardware, self.coeffs, causal_skip=train.attention == "flash"
        )
        self.rate = self.price.flops_per_s
        self.layer_overhead = self.price.layer_overhead_s
        self.elementwise = self.price.elementwise_s
        self.d_attn = model.num_heads * model.dim_per_head
        self.kv_dim = 2 * model.kv_heads * model.dim_per_head  # K and V
        self.top_k = model.moe.top_k if model.moe is not None else 0
        self.layout_rejections: list[str] = []
        self.layouts_refused = 0
        self._costs: dict[Layout, _LayoutCosts] = {}
        self._shapes: list[_Shape] | None = None
        self._work: dict[tuple[bool, bool, int, int], tuple[int, int]] = {}
        self.budget = budget
        self.check = check or _unchecked
        self.over = {e: overheads(self.coeffs, hardware, e) for e in (False, True)}
        self.offers_selective_op = selective_op_offered(model, self.coeffs)
        self.segments = (
            (want.expandable_segments,)
            if want.expandable_segments is not None
            else tuple(dict.fromkeys((self.train.expandable_segments, True)))
        )
        self._check_constraints()

    def _check_constraints(self) -> None:
        """Refuse a constraint no layout can meet whatever the others are, naming its key and
        why (``_unmet`` refuses constraints no layout meets together)."""
        want, model, g, seq = self.want, self.model, self.hw.gpus_per_node, self.seq
        layers, framework = model.num_layers, self.train.framework
        if want.tp is not None:
            check_layout(model, want.tp, 1, 1)  # the heads, KV heads and FFN widths
            if g % want.tp:
                _refuse_key(
                    "parallel.tp",
                    f"tensor parallelism stays inside a node of {g} GPUs; allowed: "
                    f"{_some(_divisors(g))}; got {want.tp}",
                )
            if want.tp > 1 and self.train.loss.priced_impl in WHOLE_VOCAB_IMPLS:
                _refuse_key(
                    "parallel.tp",
                    f"{_loss_name(self.train.loss)} runs on a whole vocabulary; allowed: 1, "
                    f"got {want.tp}",
                )
            if self.sequence_parallel(want.tp) and want.tp > 1 and seq % want.tp:
                _refuse_key(
                    "parallel.tp",
                    f"sequence parallelism splits each sequence over TP: seq_len ({seq}) must "
                    f"divide by it; got {want.tp}",
                )
        if want.pp is not None:
            check_layout(model, 1, want.pp, 1)  # a layer per stage
            if framework == "megatron" and layers % want.pp:
                _refuse_key(
                    "parallel.pp",
                    _MEGATRON_PP.format(pp=want.pp, layers=layers)
                    + f"; allowed: {_some(_divisors(layers))}",
                )
            if want.pp > 1 and not self.pipeline_zero_stages:
                _refuse_key(
                    "parallel.pp",
                    "DeepSpeed's pipeline engine runs ZeRO stage 1 at most (ZeRO-2 and ZeRO-3 "
                    f"are incompatible with pipeline parallelism); allowed with zero_stage "
                    f"{self.zero_stages[0]}: 1, got {want.pp}",
                )
        if want.vpp is not None and want.vpp > 1:
            if framework == "deepspeed":
                _refuse_key(
                    "parallel.vpp",
                    f"DeepSpeed's pipeline engine runs 1F1B only; allowed: 1, got {want.vpp}",
                )
            if want.pp == 1:
                _refuse_key(
                    "parallel.vpp",
                    f"the interleaved schedule needs parallel.pp > 1; allowed with pp=1: 1, got "
                    f"{want.vpp}",
                )
            if want.pp is not None:
                check_interleaving(model, want.pp, want.vpp)
            elif layers % want.vpp or layers // want.vpp < 2:
                _refuse_key(
                    "parallel.vpp",
                    f"num_layers ({layers}) must divide into pp x vpp equal chunks with pp > 1; "
                    f"got {want.vpp}",
                )
        if want.cp is not None and want.cp > 1:
            if model.mla is not None:
                _refuse_key(
                    "parallel.cp",
                    "context parallelism is not planned for MLA attention; allowed: 1, got "
                    f"{want.cp}",
                )
            if seq % (2 * want.cp):
                allowed = [
                    c for c in _divisors(seq) if c <= self.gpus and (c == 1 or seq % (2 * c) == 0)
                ]
                _refuse_key(
                    "parallel.cp",
                    "load-balanced ring attention (Megatron's, torchtitan's) cuts each sequence "
                    f"into 2 x cp equal chunks: seq_len ({seq}) must divide by 2 x cp; allowed: "
                    f"{_some(allowed)}; got {want.cp}",
                )
        if want.ep is not None:
            check_layout(model, 1, 1, want.ep)  # whole experts per rank
        for key, degree in (
            ("parallel.tp", want.tp),
            ("parallel.pp", want.pp),
            ("parallel.cp", want.cp),
            ("parallel.ep", want.ep),
            ("parallel.dp", want.dp),
        ):
            if degree is not None and degree > self.gpus:
                _refuse_key(key, f"the plan has at most {self.gpus} GPUs; got {degree}")
        for key, n in (
            ("parallel.dp", want.dp),
            ("micro_batch_size", want.micro_batch_size),
            ("grad_accum_steps", want.grad_accum_steps),
        ):
            if n is not None and self.batch % n:
                _refuse_key(
                    key,
                    f"must divide the global batch ({self.batch} = dp x micro_batch_size x "
                    f"grad_accum_steps); allowed: {_some(_divisors(self.batch))}; got {n}",
                )
        if want.recompute == "selective_op":
            check_selective_op(model, self.coeffs)
            if want.cp is not None and want.cp > 1:
                _refuse_key(
                    "recompute",
                    f"selective_op is priced for parallel.cp 1; got cp={want.cp}",
                )
        if self.modes == ("streaming",):
            if (want.tp or 1) > 1 or (want.pp or 1) > 1:
                _refuse_key(
                    "offload.mode",
                    "streaming runs one layer stream per GPU; it needs parallel.tp=1 and "
                    f"parallel.pp=1, got tp={want.tp or 1} pp={want.pp or 1}",
                )
            if want.recompute not in (None, "none"):
                _refuse_key(
                    "recompute",
                    "offload.mode streaming checkpoints its own blocks "
                    "(offload.checkpoint_every); allowed with streaming: none",
                )
        every = want.offload_checkpoint_every
        if every is not None and every > layers:
            _refuse_key(
                "offload.checkpoint_every",
                f"must be between 1 and num_layers ({layers}), got {every}",
            )

    # -- layouts ---------------------------------------------------------------------------

    def shapes(self) -> list[_Shape]:
        """Every (world, TP, PP, CP, DP) of at most ``gpus`` GPUs (whole nodes, or part of one
        node) that the model and the global batch divide into and the constraints allow, with
        the interleavings and EP degrees each takes: what ``layouts`` makes layouts of (worked
        out once; a few thousand at most where the layouts are hundreds of thousands). Each
        is valid for the framework that runs it (``planner.layout``'s docstring, "Rules")."""
        if self._shapes is not None:
            return self._shapes
        g = self.hw.gpus_per_node
        model, want = self.model, self.want
        out: list[_Shape] = []
        worlds = [w for w in range(1, self.gpus + 1) if w < g or w % g == 0]
        experts = model.moe.num_experts if model.moe is not None else 1
        loss = self.train.loss
        megatron = self.train.framework == "megatron"
        # check_layout's verdict on (tp, pp), for every world they divide
        refusals: dict[tuple[int, int], str | None] = {}
        for world in worlds:
            for tp in _wanted(_divisors(math.gcd(world, g)), want.tp):
                if tp > 1 and loss.priced_impl in WHOLE_VOCAB_IMPLS:
                    self._refuse(f"tp={tp}: {_loss_name(loss)} runs on a whole vocabulary")
                    continue
                for pp in _wanted(_divisors(world // tp), want.pp):
                    if pp > model.num_layers:
                        continue
                    if (tp, pp) not in refusals:
                        try:
                            check_layout(model, tp, pp, 1)
                            refusals[tp, pp] = None
                        except SpecError as exc:
                            refusals[tp, pp] = str(exc)
                        if megatron and refusals[tp, pp] is None and model.num_layers % pp:
                            refusals[tp, pp] = _MEGATRON_PP.format(pp=pp, layers=model.num_layers)
                        if pp > 1 and refusals[tp, pp] is None and not self.pipeline_zero_stages:
                            refusals[tp, pp] = (
                                f"pp={pp}: DeepSpeed's pipeline engine runs ZeRO stage 1 at most "
                                f"(stages searched: {', '.join(map(str, self.zero_stages))})"
                            )
                    refused = refusals[tp, pp]
                    if refused is not None:
                        self._refuse(refused)
                        continue
                    for cp in _wanted(_divisors(world // (tp * pp)), want.cp):
                        dp = world // (tp * pp * cp)
                        if want.dp is not None and dp != want.dp:
                            continue
                        # load-balanced ring attention (Megatron's zigzag, torchtitan's
                        # head-tail) cuts each sequence into 2 x cp equal chunks
                        if cp > 1 and (self.seq % (2 * cp) or model.mla is not None):
                            continue
                        if self.batch % dp:
                            self.layouts_refused += 1
                            if len(self.layout_rejections) < MAX_LAYOUT_REJECTIONS:
                                self._note(
                                    f"dp={dp} (world {world} = tp {tp} x pp {pp} x cp {cp} x "
                                    f"dp): the global batch ({self.batch}) is not divisible by dp"
                                )
                            continue
                        # sequence parallelism scatters each CP rank's sequence over TP
                        if self.sequence_parallel(tp) and tp > 1 and self.seq // cp % tp:
                            continue
                        if loss.impl == "chunked_linear" and -(-self.seq // cp) % loss.num_chunks:
                            continue  # its chunks must divide the rank's sequence
                        # the EP degrees dividing both dp x cp and the experts
                        eps = _wanted(_divisors(math.gcd(dp * cp, experts)), want.ep)
                        # the interleavings with a candidate (``micro_batches``)
                        vpps = tuple(
                            v
                            for v in self.interleavings(pp)
                            if self.layout_work(tp, pp, cp, dp, v)[1]
                        )
                        if vpps and eps:
                            out.append(_Shape(world, tp, pp, cp, dp, vpps, tuple(eps)))
        self._shapes = out
        return out

    def interleavings(self, pp: int) -> tuple[int, ...]:
        """The ``vpp`` a pipeline of ``pp`` stages takes: 1 (1F1B), and the virtual stages per
        rank (up to ``PLAN_MAX_VPP``) that split the layers into equal model chunks; none but 1
        under DeepSpeed, whose pipeline engine runs 1F1B only (``TrainSchedule``); 2 alone for
        a V schedule, which needs a pipeline."""
        layers = self.model.num_layers
        if self.train.parallel.pp_schedule in SINGLE_STAGE:
            return (1,) if self.want.vpp in (None, 1) else ()
        if self.train.parallel.pp_schedule in V_SHAPED:  # two chunks per rank, in a V
            if pp == 1:  # no pipeline: one stage, whatever the schedule
                return (1,) if self.want.vpp in (None, 1) else ()
            return (2,) if pp <= layers // 2 and self.want.vpp in (None, 2) else ()
        if self.want.vpp is not None:
            v = self.want.vpp
            ok = v == 1 or (
                pp > 1 and layers % (pp * v) == 0 and self.train.framework != "deepspeed"
            )
            return (v,) if ok else ()
        if pp == 1 or self.train.framework == "deepspeed":
            return (1,)
        return (1, *(v for v in range(2, PLAN_MAX_VPP + 1) if layers % (pp * v) == 0))

    def bubble(self, pp: int, vpp: int, grad_accum: int | None = None) -> float:
        """The pipeline's fill and drain in micro-batch times under the spec's schedule
        (``planner.schedules.bubble_micro_batches``), with ``grad_accum`` micro-batches
        (None: enough to fill it)."""
        named = self.train.parallel.pp_schedule
        return bubble_micro_batches(pp, vpp, named, grad_accum)

    def sequence_parallel(self, tp: int) -> bool:
        """Whether a layout of ``tp`` runs sequence parallelism: wherever tp > 1, unless the
        constraints say."""
        given = self.want.sequence_parallel
        return tp > 1 if given is None else given

    def zeros(self, pp: int, sharded: bool) -> tuple[int, ...]:
        """The ZeRO stages a layout of ``pp`` stages tries: the framework's (or the
        constraint's), those DeepSpeed's pipeline engine runs under a pipeline, and only the
        first where nothing is sharded (``dp x cp`` of 1)."""
        stages = self.zero_stages if pp == 1 else self.pipeline_zero_stages
        return stages if sharded else stages[:1]

    def micro_batches(self, dp: int, pp: int, vpp: int) -> list[int]:
        """The micro-batches a rank of a layout tries: powers of two that divide its share of
        the global batch, or the constraints' micro-batch and accumulation; of those, the ones
        whose micro-batch count the schedule runs."""
        per_rank = self.batch // dp
        want = self.want
        if want.micro_batch_size is None and want.grad_accum_steps is None:
            micro = _micro_batches(per_rank)
        else:
            mb = want.micro_batch_size
            if mb is None:
                ga = want.grad_accum_steps or 1
                mb = per_rank // ga if per_rank % ga == 0 else 0
            ok = mb > 0 and per_rank % mb == 0
            if ok and want.grad_accum_steps is not None:
                ok = per_rank // mb == want.grad_accum_steps
            micro = [mb] if ok else []
        # the schedule's rule (``planner.schedules.micro_batch_rule``): a named schedule is
        # torch's; an unnamed interleaved one is Megatron-Core's
        named = self.train.parallel.pp_schedule
        return [mb for mb in micro if micro_batch_rule(named, pp, vpp, per_rank // mb) is None]

    def layouts(self) -> list[Layout]:
        """Every layout of at most ``gpus`` GPUs (whole nodes, or part of one node) that the
        model and the global batch divide into."""
        return [
            Layout(s.world, s.tp, s.pp, vpp, s.cp, s.dp, ep)
            for s in self.shapes()
            for vpp in s.vpps
            for ep in s.eps
        ]

    def layout_work(self, tp: int, pp: int, cp: int, dp: int, vpp: int) -> tuple[int, int]:
        """(groups, candidates) ``candidates`` considers for a layout of these degrees (any
        ``ep``): a group per ZeRO stage, placement and micro-batches with or without
        accumulation, each with its micro-batches x recomputes."""
        zeros = len(self.zeros(pp, dp * cp > 1))
        # what the placements and recomputes depend on, and the micro-batches
        key = (tp == 1 and pp == 1, cp == 1, dp, pp if vpp > 1 else 0)
        work = self._work.get(key)
        if work is None:
            lay = Layout(tp * pp * cp * dp, tp, pp, vpp, cp, dp, 1)
            per_rank = self.batch // dp
            micro = self.micro_batches(dp, pp, vpp)
            # the micro-batch of the whole per-rank batch is the one without accumulation
            splits = len({per_rank // mb > 1 for mb in micro})
            recomputes = len(self.recomputes(lay))
            groups = candidates = 0
            for placement in self.placements(lay):
                n = 1 if placement[0] == "streaming" else recomputes
                if n:
                    groups += splits
                    candidates += len(micro) * n
            work = self._work[key] = (groups, candidates)
        return zeros * work[0], zeros * work[1]

    def size(self) -> SearchSize:
        """The layouts, groups and candidates the search would consider, counted from the
        degrees' divisor sets without making any layout."""
        layouts = groups = candidates = 0
        for s in self.shapes():
            n = len(s.eps)
            for vpp in s.vpps:
                g, c = self.layout_work(s.tp, s.pp, s.cp, s.dp, vpp)
                layouts += n
                groups += n * g
                candidates += n * c
        return SearchSize(layouts, groups, candidates)

    def count(self, lays: list[Layout]) -> tuple[int, int]:
        """(groups, candidates) ``candidates`` considers for ``lays``, before pricing any."""
        groups = candidates = 0
        for lay in lays:
            layout_groups, layout_candidates = self.layout_work(
                lay.tp, lay.pp, lay.cp, lay.dp, lay.vpp
            )
            groups += layout_groups
            candidates += layout_candidates
        return groups, candidates

    def check_size(self, budget: PlanBudget) -> SearchSize:
        """The search's size, refused (a ``SpecError`` naming what narrows it and the limits)
        over ``budget``'s layouts or candidates, before any layout is made."""
        size = self.size()
        if not size.candidates and self.want.given():
            self._unmet()
        if size.layouts <= budget.layouts and size.candidates <= budget.candidates:
            return size
        g = self.hw.gpus_per_node
        worlds = min(self.gpus, g - 1) + self.gpus // g
        model = self.model
        narrower = [
            f"fewer gpus ({worlds:,} world sizes) or a gpus_per_node with fewer divisors ({g} "
            f"has {len(_divisors(g))}: the TP degrees)",
            f"a global_batch with fewer divisors ({self.batch} has {len(_divisors(self.batch))}: "
            "the DP degrees and micro-batches)",
            f"a seq_len with fewer divisors ({self.seq} has {len(_divisors(self.seq))}: the CP "
            "degrees)",
        ]
        parts = (
            f"layers ({model.num_layers} has {len(_divisors(model.num_layers))}: the PP degrees)"
        )
        if model.moe is not None and model.moe.num_experts > 1:
            experts = model.moe.num_experts
            parts += f" or experts ({experts} has {len(_divisors(experts))}: the EP degrees)"
        narrower.append(f"a model whose {parts} have fewer divisors")
        raise SpecError(
            f"gpus: planning at most {self.gpus} GPUs would consider {size.layouts:,} layouts and "
            f"{size.candidates:,} candidates; a plan may consider at most {budget.layouts:,} "
            f"layouts and {budget.candidates:,} candidates. Narrow the search: "
            + "; ".join(narrower),
            field="gpus",
        )

    def recomputes(self, lay: Layout) -> tuple[int, ...]:
        """``recompute_table`` indices a non-streaming candidate of ``lay`` tries: the
        constraint's, else ``RECOMPUTE``'s; torchtitan's per-op policy where its profile runs
        it (or the constraint names it) and the layout has no context parallelism."""
        if self.want.recompute is not None:
            wanted = len(self.recompute_table) - 1
            if not isinstance(self.want.recompute, Recompute):
                wanted = [r[0] for r in RECOMPUTE].index(self.want.recompute)
            return (wanted,) if wanted != SELECTIVE_OP or lay.cp == 1 else ()
        every = range(len(RECOMPUTE))
        if self.offers_selective_op and lay.cp == 1:
            return tuple(every)
        return tuple(r for r in every if r != SELECTIVE_OP)

    def _with(self) -> str:
        """The constraints, for a reason: `` with parallel.tp=8``, or nothing."""
        return f" with {self.want.text()}" if self.want.given() else ""

    def zero_reason(self) -> str:
        """Which ZeRO stages the search tries, and why."""
        stages = ", ".join(map(str, self.zero_stages))
        reason = f"ZeRO stages searched: {stages} ({self.zero_why}"
        if self.pipeline_zero_stages != self.zero_stages:
            piped = ", ".join(map(str, self.pipeline_zero_stages)) or "none"
            reason += f"; with pp > 1: {piped}, as DeepSpeed's pipeline engine runs"
        return reason + ")"

    def _unmet(self) -> NoReturn:
        """Refuse constraints no layout of at most ``gpus`` GPUs meets together, naming them
        (each alone was checked by ``_check_constraints``) and why layouts were refused."""
        given = self.want.given()
        why = "; ".join(self.layout_rejections)
        raise SpecError(
            f"train: no layout of at most {self.gpus} GPUs ({self.hw.gpus_per_node} per node) "
            f"meets {self.want.text()} with a global batch of {self.batch} and seq_len "
            f"{self.seq}"
            + (f" ({why})" if why else "")
            + "; remove or change "
            + ("it" if len(given) == 1 else "one of them"),
            field=f"train.{next(iter(given))}" if len(given) == 1 else "train",
        )

    def _refuse(self, why: str) -> None:
        self.layouts_refused += 1
        self._note(why)

    def _note(self, why: str) -> None:
        if (
            len(self.layout_rejections) < MAX_LAYOUT_REJECTIONS
            and why not in self.layout_rejections
        ):
            self.layout_rejections.append(why)

    def floor_costs(self, lay: Layout) -> _FloorCosts:
        """What ``floor`` reads of a layout's costs, without its stages' parameters (which
        ``costs`` works out for the layouts the walk prices only)."""
        model, ln = self.model, self.links
        tp, pp, cp, dp, ep = lay.tp, lay.pp, lay.cp, lay.dp, lay.ep
        sp = tp > 1 and self.sequence_parallel(tp)
        pb = self.base.param_bytes
        tokens = self.seq // cp  # a sequence's tokens on this rank
        hidden_bytes = tokens * model.hidden_size * pb
        tp_b, tp_c = all_reduce_cost(tp, 1, ln)
        # two all-reduces (or all-gather + reduce-scatter pairs) per layer and pass
        tp_b, tp_c = 2 * tp_b * hidden_bytes, 2 * tp_c
        ep_b = ep_c = 0.0
        if ep > 1 and self.top_k:
            routed = (tokens // tp if sp else tokens) * self.top_k * model.hidden_size * pb
            a_b, a_c = all_to_all_cost(ep, tp, ln)
            ep_b, ep_c = 2 * a_b * routed, 2 * a_c  # dispatch and combine
        pp_b = pp_c = 0.0
        if pp > 1:
            per_b, lat = p2p_cost(tp * cp * dp, ln)
            pp_b, pp_c = (hidden_bytes // tp if sp else hidden_bytes) * per_b, lat
        # the first stage's layers (``stage_layer_ranges``: the earlier stages take the rest)
        layers = -(-model.num_layers // pp)
        return _FloorCosts(
            tp_b, tp_c, ep_b, ep_c, pp_b, pp_c, layers, model.moe_layers_between(0, layers)
        )

    def costs(self, lay: Layout) -> _LayoutCosts:
        """A layout's per-byte communication costs, resolved once."""
        model, ln = self.model, self.links
        tp, pp, cp, dp, ep = lay.tp, lay.pp, lay.cp, lay.dp, lay.ep
        f = self.floor_costs(lay)
        pb = self.base.param_bytes
        tokens = self.seq // cp  # a sequence's tokens on this rank
        cp_b = cp_c = 0.0
        if cp > 1:
            per_b, lat = p2p_cost(tp, ln)
            kv = tokens * self.kv_dim * pb // tp
            comm = (cp - 1) * kv * per_b
            # the forward attention of a sequence's shard: 2 x d_attn x seq FLOPs per token
            attention = 2 * self.d_attn * self.seq * tokens / tp / self.rate
            cp_b, cp_c = comm - attention, (cp - 1) * lat
        v = self.train.parallel.pp_schedule in V_SHAPED
        sp0 = stage_params(model, tp, pp, ep, 0, v)
        dp_group = dp * cp
        return _LayoutCosts(
            f.tp_b,
            f.tp_c,
            f.ep_b,
            f.ep_c,
            cp_b,
            cp_c,
            f.pp_b,
            f.pp_c,
            sp0.num_layers,
            sp0.num_moe_layers,
            sp0.dense_numel,
            sp0.expert_numel,
            all_reduce_cost(dp_group, tp * cp if cp > 1 else tp, ln),
            all_reduce_cost(dp_group // ep, tp * ep, ln),
            host_layer_floor(self.coeffs, lay, ln.gpus_per_node),
        )

    # -- pricing ---------------------------------------------------------------------------

    def step_terms(
        self,
        lay: Layout,
        c: _LayoutCosts,
        zero: int,
        mode: str,
        offloaded_numel: int,
        mb: int,
        recompute: int,
    ) -> StepTerms:
        """A candidate's step, term by term (see the module docstring)."""
        price = self.price
        tp, pp, cp, dp, vpp = lay.tp, lay.pp, lay.cp, lay.dp, lay.vpp
        m = self.batch // (dp * mb)
        streaming = mode == "streaming"
        selective = self.recompute_table[recompute][1]
        recomputes = streaming or self.recompute_table[recompute][2] is not None
        op = recompute == SELECTIVE_OP and not streaming
        flops = price.flops_base
        if recomputes:
            flops += price.flops_recompute
        elif selective:
            flops += price.flops_selective
        elif op:
            flops += price.flops_selective_op
        tokens_micro = mb * self.seq / cp
        # the per-op policy re-runs every elementwise operation and launch of the block
        passes = 3 if recomputes or op else 2
        tp_passes = SELECTIVE_OP_TP_PASSES if op else passes
        compute_micro = flops * tokens_micro / (tp * pp) / self.rate
        compute_micro += passes * c.layers * tokens_micro * self.elementwise / tp
        # kernel launches and small operations: a fixed time per layer and pass
        compute_micro += passes * c.layers * self.layer_overhead
        tp_micro = tp_passes * c.layers * (c.tp_b * mb + c.tp_c) if tp > 1 else 0.0
        ep_micro = passes * c.moe_layers * (c.ep_b * mb + c.ep_c) if c.ep_b else 0.0
        # the ring exchange beyond the attention it hides: forward, backward (twice the bytes
        # and FLOPs), the recompute's forward
        cp_micro = (passes + 1) * c.layers * max(0.0, c.cp_b * mb + c.cp_c) if cp > 1 else 0.0
        pp_micro = 2 * vpp * (c.pp_b * mb + c.pp_c) if pp > 1 else 0.0
        # ZeRO / FSDP: parameters gathered for each micro-batch's forward and backward, its
        # gradients reduce-scattered, overlapped with its compute
        base = self.base
        dense, expert = c.dense_numel, c.expert_numel
        reduce_bytes = base.reduce_bytes
        dp_ar_b, dp_ar_c = c.dp_ar
        e_ar_b, e_ar_c = c.edp_ar
        z3_micro = 0.0
        dp_comm = 0.0
        # one all-gather or reduce-scatter is half an all-reduce
        grads_ar = (dense * dp_ar_b + expert * e_ar_b) * reduce_bytes + dp_ar_c + e_ar_c
        params_ag = ((dense * dp_ar_b + expert * e_ar_b) * base.param_bytes + dp_ar_c + e_ar_c) / 2
        if dp * cp > 1:
            if zero == 3:
                z3_micro = max(0.0, 2 * params_ag + grads_ar / 2 - compute_micro)
            else:
                backward = compute_micro * 2 / 3
                forward = compute_micro / 3
                if zero == 0:
                    dp_comm = max(0.0, grads_ar - backward)
                else:
                    dp_comm = max(0.0, grads_ar / 2 - backward) + max(0.0, params_ag - forward)
        micro = compute_micro + tp_micro + ep_micro + cp_micro + pp_micro + z3_micro
        # the host's least time per micro-batch: the GPU's work hides it only when longer
        host_micro = max(0.0, passes * c.layers * c.host_layer - micro)
        micro += host_micro
        bubble = self.bubble(pp, vpp, m) * micro
        pipeline = m * micro + bubble
        # the optimizer step on the GPU: its state's traffic (read and write master and
        # moments, read the gradient, write the parameter)
        shard = dp * cp if zero >= 1 else 1
        on_gpu = (dense + expert) / shard - (offloaded_numel if mode == "optimizer" else 0)
        touched = (
            2 * (base.master_bytes + 2 * base.state_bytes) + base.grad_bytes + base.param_bytes
        )
        gpu_opt = (
            0.0 if streaming else max(0.0, on_gpu) * touched / self.hw.memory_bandwidth_bytes_per_s
        )
        grad_bytes = 2 if base.grad_bytes <= 2 else 4
        if streaming:
            numel = dense + expert
            transfer = m * numel * (2 * base.param_bytes + grad_bytes) / price.link
            cpu = numel / price.cpu_rate
            forward = micro * price.flops_recompute / flops
            step = streaming_step_seconds(
                pipeline, transfer, cpu, micro, forward, base.clips_grad_norm
            )
            step += dp_comm
        else:
            transfer = offloaded_numel * (base.param_bytes + grad_bytes) / price.link
            cpu = offloaded_numel / price.cpu_rate
            step = pipeline + dp_comm + gpu_opt + max(transfer, cpu)
        return StepTerms(
            m * compute_micro,
            bubble,
            m * tp_micro,
            m * ep_micro,
            m * cp_micro,
            m * pp_micro,
            dp_comm + m * z3_micro,
            transfer,
            cpu,
            gpu_opt,
            m * host_micro,
            step,
        )

    # -- search ----------------------------------------------------------------------------

    def placements(self, lay: Layout) -> list[tuple[str, float, int | None]]:
        """(mode, fraction, streaming block) choices of a layout: the framework's offload
        modes (or the constraint's), the constraint's fraction or block where given; streaming
        (which checkpoints its own blocks) where the layout has no TP or PP and no recompute
        other than none is asked for."""
        want = self.want
        out: list[tuple[str, float, int | None]] = []
        if "none" in self.modes:
            out.append(("none", 1.0, None))
        if "optimizer" in self.modes:
            fractions = (
                PLAN_OFFLOAD_FRACTIONS
                if want.offload_fraction is None
                else (want.offload_fraction,)
            )
            out += [("optimizer", f, None) for f in fractions]
        if (
            "streaming" in self.modes
            and lay.tp == 1
            and lay.pp == 1
            and want.recompute in (None, "none")
        ):
            blocks = (
                PLAN_STREAMING_EVERY
                if want.offload_checkpoint_every is None
                else (want.offload_checkpoint_every,)
            )
            out += [("streaming", 1.0, k) for k in blocks if k <= self.model.num_layers]
        return out

    def settings(
        self,
        lay: Layout,
        zero: int,
        placement: tuple[str, float, int | None],
        mb: int,
        recompute: int,
        segments: bool,
    ) -> Knobs:
        """A candidate's knobs (what ``knobs`` makes of its training spec)."""
        mode, fraction, block = placement
        _, selective, every = self.recompute_table[recompute]
        return self.base._replace(
            micro_batch=mb,
            grad_accum=self.batch // (lay.dp * mb),
            dp=lay.dp,
            tp=lay.tp,
            pp=lay.pp,
            ep=lay.ep,
            cp=lay.cp,
            vpp=lay.vpp,
            sequence_parallel=self.sequence_parallel(lay.tp),
            zero_stage=zero,
            offload_mode=mode,
            offload_fraction=fraction,
            selective=selective,
            selective_op=recompute == SELECTIVE_OP and mode != "streaming",
            checkpoint_every=block if mode == "streaming" else every,
            expandable_segments=segments,
        )

    def keys(self, cand: Candidate) -> dict[str, Any]:
        """The training-spec keys a candidate sets (what the plan chooses)."""
        lay = cand.layout
        mode, fraction, block = self.placements(lay)[cand.placement]
        offload: dict[str, Any] = {"mode": mode}
        if mode == "optimizer":
            offload["fraction"] = fraction
        elif mode == "streaming":
            offload["checkpoint_every"] = block
        return {
            "micro_batch_size": cand.micro_batch,
            "grad_accum_steps": self.batch // (lay.dp * cand.micro_batch),
            "recompute": _spec_value(self.recompute_table[cand.recompute][0]),
            "offload": offload,
            "expandable_segments": cand.segments,
            "parallel": {
                "dp": lay.dp,
                "tp": lay.tp,
                "pp": lay.pp,
                "vpp": lay.vpp,
                "cp": lay.cp,
                "ep": lay.ep,
                "sequence_parallel": self.sequence_parallel(lay.tp),
                "zero_stage": cand.zero,
                **(
                    {"pp_schedule": self.train.parallel.pp_schedule}
                    if self.train.parallel.pp_schedule is not None
                    else {}
                ),
            },
        }

    def spec(self, cand: Candidate) -> TrainSpec:
        """A candidate's training spec: the input's, with the keys the plan chose."""
        keys = self.keys(cand)
        keys["offload"] = {**keys["offload"], "num_buffers": self.train.offload.num_buffers}
        return TrainSpec.model_validate({**self.train.model_dump(), **keys})

    def price_group(
        self,
        lay: Layout,
        c: _LayoutCosts,
        zero: int,
        mode: str,
        offloaded_numel: int,
        mbs: list[int],
        recomputes: tuple[int, ...],
        key: int,
        out: list[tuple[float, int]],
    ) -> None:
        """Append ``(step, key | micro-batch index << 4 | recompute)`` of each of a group's
        candidates to ``out``: ``step_terms``' step, its per-layout and per-group parts
        hoisted out of the loop (``tests/planner/test_plan.py`` holds the two equal)."""
        price, base = self.price, self.base
        tp, pp, cp, dp, vpp = lay.tp, lay.pp, lay.cp, lay.dp, lay.vpp
        per_rank = self.batch // dp
        streaming = mode == "streaming"
        dense, expert = c.dense_numel, c.expert_numel
        dp_ar_b, dp_ar_c = c.dp_ar
        e_ar_b, e_ar_c = c.edp_ar
        grads_ar = (dense * dp_ar_b + expert * e_ar_b) * base.reduce_bytes + dp_ar_c + e_ar_c
        params_ag = ((dense * dp_ar_b + expert * e_ar_b) * base.param_bytes + dp_ar_c + e_ar_c) / 2
        sharded = dp * cp > 1
        shard = dp * cp if zero >= 1 else 1
        on_gpu = (dense + expert) / shard - (offloaded_numel if mode == "optimizer" else 0)
        touched = (
            2 * (base.master_bytes + 2 * base.state_bytes) + base.grad_bytes + base.param_bytes
        )
        grad_bytes = 2 if base.grad_bytes <= 2 else 4
        if streaming:
            numel = dense + expert
            per_micro_transfer = numel * (2 * base.param_bytes + grad_bytes) / price.link
            cpu = numel / price.cpu_rate
            tail = 0.0
        else:
            gpu_opt = max(0.0, on_gpu) * touched / self.hw.memory_bandwidth_bytes_per_s
            transfer = offloaded_numel * (base.param_bytes + grad_bytes) / price.link
            tail = gpu_opt + max(transfer, offloaded_numel / price.cpu_rate)
        fill = self.bubble(pp, vpp)
        fill_by_count = self.train.parallel.pp_schedule in BY_COUNT
        scale = self.seq / cp / (tp * pp) / self.rate
        layers, moe_layers = c.layers, c.moe_layers
        for r in recomputes:
            _, selective, every = self.recompute_table[r]
            recomputing = streaming or every is not None
            op = r == SELECTIVE_OP and not streaming
            flops = price.flops_base
            if recomputing:
                flops += price.flops_recompute
            elif selective:
                flops += price.flops_selective
            elif op:
                flops += price.flops_selective_op
            passes = 3 if recomputing or op else 2
            tp_passes = SELECTIVE_OP_TP_PASSES if op else passes
            k_compute = flops * scale + passes * layers * self.seq / cp * self.elementwise / tp
            c_compute = passes * layers * self.layer_overhead
            a_comm = b_comm = 0.0
            if tp > 1:
                a_comm += tp_passes * layers * c.tp_b
                b_comm += tp_passes * layers * c.tp_c
            if c.ep_b:
                a_comm += passes * moe_layers * c.ep_b
                b_comm += passes * moe_layers * c.ep_c
            if pp > 1:
                a_comm += 2 * vpp * c.pp_b
                b_comm += 2 * vpp * c.pp_c
            cp_scale = (passes + 1) * layers
            host = passes * layers * c.host_layer
            for i, mb in enumerate(mbs):
                compute_micro = k_compute * mb + c_compute
                micro = compute_micro + a_comm * mb + b_comm
                if cp > 1:
                    exposed = c.cp_b * mb + c.cp_c
                    if exposed > 0:
                        micro += cp_scale * exposed
                dp_comm = 0.0
                if sharded:
                    if zero == 3:
                        gather = 2 * params_ag + grads_ar / 2 - compute_micro
                        if gather > 0:
                            micro += gather
                    elif zero == 0:
                        dp_comm = max(0.0, grads_ar - compute_micro * 2 / 3)
                    else:
                        dp_comm = max(0.0, grads_ar / 2 - compute_micro * 2 / 3) + max(
                            0.0, params_ag - compute_micro / 3
                        )
                if micro < host:
                    micro = host
                m = per_rank // mb
                if fill_by_count:  # its fill depends on the count
                    fill = self.bubble(pp, vpp, m)
                pipeline = (m + fill) * micro
                if streaming:
                    forward = micro * price.flops_recompute / flops
                    step = (
                        streaming_step_seconds(
                            pipeline,
                            m * per_micro_transfer,
                            cpu,
                            micro,
                            forward,
                            base.clips_grad_norm,
                        )
                        + dp_comm
                    )
                else:
                    step = pipeline + dp_comm + tail
                out.append((step, key | i << 4 | r))

    def candidates(
        self,
        lays: list[Layout],
        groups: list[Any],
        rejected: dict[str, int],
    ) -> list[tuple[float, int]]:
        """The candidates of ``lays`` priced as ``(step, key)``; the key indexes the group
        appended to ``groups``; groups whose model-state floor exceeds the GPU are counted in
        ``rejected`` unpriced."""
        model, coeffs, cap = self.model, self.coeffs, self.hw.memory_bytes
        # the floor holds for either allocator mode: the context and the smaller overhead
        context = self.over[False].cuda_context_bytes
        least = min(o.allocator_overhead_fraction for o in self.over.values())
        priced: list[tuple[float, int]] = []
        for lay in lays:
            c = self._costs.get(lay)
            if c is None:
                c = self._costs[lay] = self.costs(lay)
            per_rank = self.batch // lay.dp
            micro = self.micro_batches(lay.dp, lay.pp, lay.vpp)
            stages = (0, lay.pp - 1) if lay.pp > 1 else (0,)
            placements = self.placements(lay)
            for zero in self.zeros(lay.pp, lay.dp * lay.cp > 1):
                for p_i, placement in enumerate(placements):
                    streaming = placement[0] == "streaming"
                    recomputes = (0,) if streaming else self.recomputes(lay)
                    if not recomputes:
                        continue
                    for accumulating in (False, True):
                        mbs = [mb for mb in micro if (per_rank // mb > 1) == accumulating]
                        if not mbs:
                            continue
                        probe = self.settings(lay, zero, placement, mbs[0], 0, False)
                        _, all_states, constants, _ = stages_states(model, probe, coeffs, stages)
                        # the optimizer phase's total: a lower bound of the stage's peak
                        alloc = max(const.optimizer for const in constants)
                        floor = alloc + context + int(alloc * least)
                        if floor + math.ceil(floor * self.margin_fraction) > cap:
                            rejected["model_states"] += len(mbs) * len(recomputes)
                            continue
                        key = len(groups) << 12
                        groups.append((lay, zero, p_i, placement, mbs))
                        self.price_group(
                            lay,
                            c,
                            zero,
                            placement[0],
                            all_states[0].offloaded_numel,
                            mbs,
                            recomputes,
                            key,
                            priced,
                        )
        return priced

    def floor(self, lay: Layout, c: _LayoutCosts | _FloorCosts) -> float:
        """No candidate of ``lay`` steps faster than this: its tokens' FLOPs without recompute
        and memory-bound traffic over its GPUs, and the communication every token pays
        whatever the micro-batch (two passes of its TP, EP and pipeline sends), without the
        latencies, bubble, exposed reductions and the optimizer."""
        per_rank = self.batch // lay.dp
        tokens = per_rank * self.seq / lay.cp
        compute = self.price.flops_base * tokens / (lay.tp * lay.pp) / self.rate
        compute += 2 * c.layers * tokens * self.elementwise / lay.tp
        comm = 0.0
        if lay.tp > 1:
            comm += 2 * c.layers * c.tp_b
        if c.ep_b:
            comm += 2 * c.moe_layers * c.ep_b
        if lay.pp > 1:
            comm += 2 * lay.vpp * c.pp_b
        return compute + per_rank * comm

    def run(
        self,
        max_listed: int = 10,
        budget: PlanBudget | None = None,
        tie_band_pct: float = TIE_BAND_PCT,
    ) -> PlanResult:
        """The fastest candidate that fits (of those within ``tie_band_pct`` % of its step, the
        one with the most GPU headroom), the runners-up and the rejections.

        The search's size is counted first and refused over ``budget``'s layouts or candidates
        (``check_size``). Layouts are taken in batches in the order of their ``floor``; once a
        batch's least floor is slower than the last runner-up found, it and every later one are
        skipped unpriced (``layouts_skipped``). Each batch's candidates are walked fastest
        first, estimated until they are slower than the last runner-up; the walk stops
        (``truncated``) before a batch that would take it past ``budget.priced`` candidates, or
        at ``budget.estimates`` estimates. ``self.check`` is called between steps."""
        budget = budget or self.budget
        model, coeffs, hw = self.model, self.coeffs, self.hw
        self.check_size(budget)
        lays = self.layouts()
        # layouts by their floor, fastest first (the larger world first on a tie)
        floors = []
        for i, lay in enumerate(lays):
            if not i % CHECK_EVERY:
                self.check()
            floors.append((self.floor(lay, self.floor_costs(lay)), -lay.world, i))
        floors.sort()
        cap, host_cap, over = hw.memory_bytes, hw.host_memory_bytes, self.over
        segments = self.segments
        rejected_by = {"model_states": 0, "gpu_memory": 0, "host_memory": 0}
        rejected: list[PlanCandidate] = []
        # (step, peak, order, candidate, host peak): the fastest found of each distinct layout
        # (degrees and ZeRO stage), at most max_listed + 1; ``listed`` holds their layouts
        fitting: list[tuple[float, int, int, Candidate, int]] = []
        listed: dict[tuple[Layout, int], float] = {}
        groups: list[Any] = []
        estimated = priced_total = skipped = walked_groups = 0
        truncated = ""
        for start in range(0, len(floors), PLAN_LAYOUTS_PER_BATCH):
            self.check()
            batch = floors[start : start + PLAN_LAYOUTS_PER_BATCH]
            batch_lays = [lays[i] for _, _, i in batch]
            if truncated or (len(fitting) > max_listed and batch[0][0] > fitting[-1][0]):
                skipped = len(floors) - start
                break
            batch_groups = self.count(batch_lays)[0]
            if walked_groups + batch_groups > budget.groups:
                truncated = (
                    f"the search stopped after {walked_groups} groups of candidates (at most "
                    f"{budget.groups})"
                )
                skipped = len(floors) - start
                break
            walked_groups += batch_groups
            priced = self.candidates(batch_lays, groups, rejected_by)
            priced_total += len(priced)
            priced.sort()
            for step, key in priced:
                if len(fitting) > max_listed and step > fitting[-1][0]:
                    break
                if estimated >= budget.estimates:
                    truncated = f"the search stopped after {estimated} estimates"
                    break
                self.check()  # a fraction of a µs, against an estimate's tens
                lay, zero, p_i, placement, mbs = groups[key >> 12]
                # a layout's faster candidate fits already: this one is no runner-up (another
                # offload fraction or micro-batch of the same layout)
                if listed.get((lay, zero), step) < step:
                    continue
                mb, r = mbs[(key >> 4) & 0xFF], key & 0xF
                for e in segments:
                    estimated += 1
                    cand = Candidate(step, key, lay, zero, p_i, mb, r, e)
                    settings = self.settings(lay, zero, placement, mb, r, e)
                    allocated, hosts = end_stages(model, settings, coeffs)
                    peak, where, _ = gpu_peak(allocated, over[e])
                    host_peak = sum(hosts[where]) * min(hw.gpus_per_node, lay.world)
                    margin = math.ceil(peak * self.margin_fraction)
                    if peak + margin > cap:
                        reason = over_gpu(peak, margin, cap)
                        kind = "gpu_memory"
                    elif host_cap is not None and host_peak > host_cap:
                        reason = over_host(host_peak, host_cap)
                        kind = "host_memory"
                    else:
                        _list(fitting, listed, (step, peak, key, cand, host_peak), max_listed)
                        break
                    if e == segments[-1]:  # its allocator modes all rejected: one candidate
                        rejected_by[kind] += 1
                        if len(rejected) < max_listed:
                            rejected.append(self._listed(cand, peak, host_peak, reason=reason))
        considered = priced_total + rejected_by["model_states"]
        layouts_considered = len(lays)
        rejected_by["layout"] = self.layouts_refused
        common: dict[str, Any] = {
            "gpus": self.gpus,
            "gpus_per_node": hw.gpus_per_node,
            "cluster": self.cluster.name,
            "gpu": hw.name,
            "global_batch": self.batch,
            "seq_len": self.seq,
            "layouts_considered": layouts_considered,
            "layouts_skipped": skipped,
            "truncated": bool(truncated),
            "candidates_considered": considered,
            "candidates_estimated": estimated,
            "rejected": rejected,
            "rejected_total": sum(rejected_by.values()),
            "rejected_by_reason": rejected_by,
            "layout_rejections": self.layout_rejections,
            "margin_pct": self.margin_pct,
            "margin_pct_used": 100 * self.margin_fraction,
            "tie_band_pct": tie_band_pct,
            "constraints": self.want.given(),
            "zero_stages": list(self.zero_stages),
            "zero_stages_reason": self.zero_reason(),
        }
        if not fitting:
            return PlanResult(
                fits=False,
                plan=None,
                budget=None,
                predicted_step_seconds=None,
                predicted_tokens_per_second=None,
                gpus_used=None,
                runners_up=[],
                reason=(
                    f"{truncated}, none of which fit"
                    if truncated
                    else f"no layout of at most {self.gpus} GPUs{self._with()} fits: every "
                    "candidate's heaviest rank exceeds the GPU or its node's host RAM"
                ),
                **common,
            )
        # as fast as the fastest (within the band): the one with the most headroom
        fastest = fitting[0][0]
        tied = [f for f in fitting if f[0] <= fastest * (1 + tie_band_pct / 100)]
        first = min(tied, key=lambda f: (f[1], f[0]))
        ordered = [first, *(f for f in fitting if f is not first)]
        best = first[3]
        plan = self.spec(best)
        chosen = estimate(model, plan, hw, coeffs)
        tokens = self.batch * self.seq
        runners_up = [
            self._listed(c, peak, host_peak, plan=self.spec(c).model_dump(mode="json"))
            for _, peak, _, c, host_peak in ordered[1:]
        ]
        chose = (
            f"the most GPU headroom within {tie_band_pct:g} % of the fastest predicted step, "
            if first is not fitting[0]
            else "fastest "
        )
        return PlanResult(
            fits=True,
            plan=plan.model_dump(mode="json"),
            budget=BudgetModel.model_validate(chosen.model_dump()),
            predicted_step_seconds=best.step,
            predicted_tokens_per_second=tokens / best.step,
            step=explain_step(self, best),
            gpus_used=best.layout.world,
            runners_up=runners_up,
            near_capacity=hw.memory_bytes - chosen.gpu_peak_bytes
            < hw.memory_bytes * NEAR_CAPACITY_PCT / 100,
            reason=f"{chose}of {considered} candidates over {layouts_considered} layouts"
            f"{self._with()} by predicted step time" + (f" ({truncated})" if truncated else ""),
            **common,
        )

    def terms(self, cand: Candidate) -> StepTerms:
        """A candidate's step, term by term."""
        lay = cand.layout
        placement = self.placements(lay)[cand.placement]
        settings = self.settings(
            lay, cand.zero, placement, cand.micro_batch, cand.recompute, cand.segments
        )
        stages = (0, lay.pp - 1) if lay.pp > 1 else (0,)
        all_states = stages_states(self.model, settings, self.coeffs, stages)[1]
        return self.step_terms(
            lay,
            self._costs[lay] if lay in self._costs else self.costs(lay),
            cand.zero,
            placement[0],
            all_states[0].offloaded_numel,
            cand.micro_batch,
            cand.recompute,
        )

    def _listed(
        self,
        cand: Candidate,
        peak: int,
        host_peak: int,
        reason: str | None = None,
        plan: dict[str, Any] | None = None,
    ) -> PlanCandidate:
        return PlanCandidate(
            **self.keys(cand),
            gpus_used=cand.layout.world,
            gpu_peak_bytes=peak,
            host_peak_bytes=host_peak,
            step_seconds=cand.step,
            tokens_per_second=self.batch * self.seq / cand.step,
            plan=plan,
            reason=reason,
        )


def _list(
    fitting: list[tuple[float, int, int, Candidate, int]],
    listed: dict[tuple[Layout, int], float],
    entry: tuple[float, int, int, Candidate, int],
    max_listed: int,
) -> None:
    """Put a fitting candidate ``(step, peak, order, candidate, host peak)`` among the fastest,
    at most one per layout (its degrees and ZeRO stage) and ``max_listed + 1`` in all: equally
    fast, the one with more headroom first; of one layout, the faster (or, as fast, the one
    with more headroom)."""
    step, peak, _, cand, _ = entry
    ident = (cand.layout, cand.zero)
    if ident in listed:
        i = next(i for i, f in enumerate(fitting) if (f[3].layout, f[3].zero) == ident)
        if fitting[i][:2] <= (step, peak):
            return
        del fitting[i]
    bisect.insort(fitting, entry)
    listed[ident] = step
    for dropped in fitting[max_listed + 1 :]:
        del listed[dropped[3].layout, dropped[3].zero]
    del fitting[max_listed + 1 :]


def explain_step(planner: Planner, cand: Candidate) -> list[StepTerm]:
    """Each term of a candidate's predicted step: its seconds, formula and inputs."""
    lay, t = cand.layout, planner.terms(cand)
    hw, cl = planner.hw, planner.cluster
    m = planner.batch // (lay.dp * cand.micro_batch)
    shape = {"micro_batch": cand.micro_batch, "micro_batches": m, "seq_len": planner.seq}
    g = hw.gpus_per_node

    def where(size: int, stride: int) -> dict[str, int]:
        per_node, nodes = group_shape(size, stride, g)
        return {"ranks": size, "per_node": per_node, "nodes": nodes}

    link = {
        "intra_node_bytes_per_s": cl.intra_node_bytes_per_s * cl.intra_node_efficiency,
        "inter_node_bytes_per_s": cl.inter_node_bytes_per_s * cl.inter_node_efficiency,
    }
    rows = [
        (
            "compute",
            t.compute,
            "micro_batches x (FLOPs per token x micro_batch x seq_len / cp / (tp x pp) / "
            "(bf16_flops x compute_efficiency) + layers x passes x (its tokens' memory-bound "
            "traffic / tp / memory bandwidth + layer_overhead_seconds)); FLOPs per token: 6 x "
            "active params + attention (causal half with flash), one more forward under "
            "recompute (selective_op: the matmuls torchtitan's per-op policy does not keep, "
            "3 passes of the memory-bound traffic)",
            {
                **shape,
                "tp": lay.tp,
                "pp": lay.pp,
                "cp": lay.cp,
                "recompute": _spec_value(planner.recompute_table[cand.recompute][0]),
                "bf16_flops": hw.bf16_flops,
                "compute_efficiency": compute_efficiency(hw, planner.coeffs.compute_efficiency),
                "elementwise_bytes_per_hidden": planner.coeffs.elementwise_bytes_per_hidden,
                "layer_overhead_seconds": planner.coeffs.layer_overhead_seconds,
                "memory_bandwidth_bytes_per_s": hw.memory_bandwidth_bytes_per_s,
            },
        ),
        (
            "bubble",
            t.bubble,
            "the schedule's fill and drain in micro-batch times x one micro-batch's time (its "
            "compute and exposed communication): 1F1B and GPipe pp - 1, interleaved and looped "
            "(pp - 1) / vpp (Narayanan et al. 2021), interleaved zero-bubble (pp - 1) / (3 vpp), "
            "the V schedules (pp - 1) / 6, ZB-V with fewer than 3 pp / 2 micro-batches "
            "(2 pp - 1 - m) / 3 (Qi et al. 2024)",
            {
                "pp": lay.pp,
                "vpp": lay.vpp,
                "micro_batches": m,
                "pp_schedule": schedule_of(planner.train.parallel.pp_schedule, lay.vpp),
                "bubble_micro_batches": planner.bubble(lay.pp, lay.vpp, m),
            },
        ),
        (
            "tp_comm",
            t.tp_comm,
            "micro_batches x layers x passes (2, 3 with recompute, 2.5 with selective_op: its "
            "policy keeps the reduce-scatters' outputs) x 2 all-reduces (all-gather "
            "+ reduce-scatter with sequence parallelism) of micro_batch x seq_len / cp x hidden "
            "x bytes, hierarchical ring over the group's links",
            {**shape, "group": where(lay.tp, 1), **link},
        ),
        (
            "ep_comm",
            t.ep_comm,
            "micro_batches x MoE layers x passes x 2 all-to-alls (dispatch, combine) of the "
            "routed tokens' hidden states (top_k per token)",
            {**shape, "group": where(lay.ep, lay.tp), **link},
        ),
        (
            "cp_comm",
            t.cp_comm,
            "micro_batches x layers x (passes + 1) x max(0, ring K/V exchange ((cp - 1) sends "
            "of the shard's K and V) - the attention it overlaps)",
            {**shape, "group": where(lay.cp, lay.tp), **link},
        ),
        (
            "pp_comm",
            t.pp_comm,
            "micro_batches x 2 x vpp sends of micro_batch x seq_len / cp x hidden x bytes (/ tp "
            "with sequence parallelism) to the next stage and back",
            {**shape, "vpp": lay.vpp, "next_stage_stride": lay.tp * lay.cp * lay.dp, **link},
        ),
        (
            "dp_comm",
            t.dp_comm,
            "ZeRO 0: all-reduce of the gradients (reduce dtype) less the last micro-batch's "
            "backward; 1-2: reduce-scatter less the backward, then the parameters' all-gather "
            "less the first forward; 3: per micro-batch two all-gathers of the parameters and a "
            "reduce-scatter of the gradients, less its compute",
            {"zero_stage": cand.zero, "group": where(lay.dp * lay.cp, lay.tp), **link},
        ),
        (
            "offload_transfer",
            t.offload_transfer,
            "offloaded gradients down and updated parameters up (optimizer offload), or every "
            "layer's weights up twice and gradients down per micro-batch (streaming), over "
            "host_link_bytes_per_s x host_link_efficiency",
            {
                "host_link_bytes_per_s": hw.host_link_bytes_per_s,
                "host_link_efficiency": planner.coeffs.host_link_efficiency,
            },
        ),
        (
            "cpu_optimizer",
            t.cpu_optimizer,
            "parameters updated on the host / cpu_optimizer_params_per_s",
            {"cpu_optimizer_params_per_s": planner.coeffs.cpu_optimizer_params_per_s},
        ),
        (
            "gpu_optimizer",
            t.gpu_optimizer,
            "the optimizer's GPU share x bytes touched per element (master and moments read "
            "and written, gradient read, parameter written) / memory bandwidth",
            {"memory_bandwidth_bytes_per_s": hw.memory_bandwidth_bytes_per_s},
        ),
        (
            "host_bound",
            t.host_bound,
            "micro_batches x the time a micro-batch waits on the host beyond its GPU work: "
            "layers x passes x the least time per layer-pass (tp_host_layer_seconds under TP > "
            "1; pp_cross_node_layer_seconds + pp_cross_node_layer_seconds_per_tp x tp where "
            "the pipeline crosses nodes) less the micro-batch's compute and exposed "
            "communication, where positive (0 for a stack no floor was measured for)",
            {
                "micro_batches": m,
                "tp": lay.tp,
                "pipeline_crosses_nodes": pipeline_crosses_nodes(lay, g),
                "tp_host_layer_seconds": planner.coeffs.tp_host_layer_seconds,
                "pp_cross_node_layer_seconds": planner.coeffs.pp_cross_node_layer_seconds,
                "pp_cross_node_layer_seconds_per_tp": (
                    planner.coeffs.pp_cross_node_layer_seconds_per_tp
                ),
            },
        ),
        (
            "step",
            t.step,
            "micro_batches x micro-batch time + bubble + exposed dp_comm + gpu_optimizer + the "
            "larger of offload_transfer and cpu_optimizer (streaming: overlapped with compute "
            "as the StepModel overlaps them)",
            {},
        ),
    ]
    return [StepTerm(term=n, seconds=s, formula=f, inputs=i) for n, s, f, i in rows]


def plan(
    model: ModelSpec,
    train: TrainSpec,
    cluster: Cluster,
    hardware: Hardware,
    gpus: int,
    global_batch: int,
    seq_len: int,
    coefficients: Coefficients | None = None,
    margin_pct: float | None = None,
    max_listed: int = 10,
    budget: PlanBudget = PLAN_BUDGET,
    check: Callable[[], None] | None = None,
    constraints: PlanConstraints | None = None,
    tie_band_pct: float = TIE_BAND_PCT,
) -> PlanResult:
    """The fastest layout of at most ``gpus`` GPUs that fits (see the module docstring), within
    ``budget``; of the layouts within ``tie_band_pct`` % of its step, the one with the most GPU
    headroom; ``check`` is called between the search's steps and may raise to stop it;
    ``constraints`` (``planner.constraints.split_plan_train``: the layout keys a training
    spec named) narrow the search to their values. ``train``'s own layout keys are the
    plan's to choose."""
    planner = Planner(
        model,
        train,
        cluster,
        hardware,
        gpus,
        global_batch,
        seq_len,
        coefficients,
        margin_pct,
        budget,
        check,
        constraints,
    )
    return planner.run(max_listed, tie_band_pct=tie_band_pct)


class StepPrice(BaseModel):
    """The predicted step of a training spec as given (``price_spec``): its time term by term,
    tokens/s and MFU, on the cluster its GPUs sit in."""

    step_seconds: float = Field(description="One optimizer step of the spec's global batch.")
    tokens_per_second: float = Field(description="Global batch x sequence over the step.")
    mfu: float = Field(
        description="Model FLOP utilisation: (6 x active parameters + 12 x layers x hidden x "
        "sequence) FLOPs per token x tokens/s over the GPUs' peak bf16 FLOP/s (the Ultra-Scale "
        "Playbook's count: attention as if not causal, no recompute)."
    )
    gpus: int = Field(description="dp x tp x pp x cp.")
    global_batch: int = Field(description="dp x micro-batch x gradient accumulation, sequences.")
    cluster: str = Field(description="The cluster whose links price the collectives.")
    terms: list[StepTerm] = Field(description="The step's terms, explained.")


def price_spec(
    model: ModelSpec,
    train: TrainSpec,
    cluster: Cluster,
    hardware: Hardware,
    coefficients: Coefficients | None = None,
) -> StepPrice:
    """The step of ``train`` exactly as given (every layout key fixed: no search, fit or not),
    priced by the plan's step model on ``cluster`` with ``hardware`` in its nodes. A layout the
    plan would refuse for its stack (a degree that does not divide the model, an interleaved
    schedule whose micro-batch count its framework refuses) is refused naming its key."""
    p = train.parallel
    world = p.dp * p.tp * p.pp * p.cp
    mode = train.offload.mode
    want = PlanConstraints(
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        cp=p.cp,
        ep=p.ep,
        dp=p.dp,
        zero_stage=p.zero_stage,
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=train.micro_batch_size,
        grad_accum_steps=train.grad_accum_steps,
        recompute=train.recompute,
        offload_mode=mode,
        offload_fraction=train.offload.fraction if mode == "optimizer" else None,
        offload_checkpoint_every=(train.offload.checkpoint_every or 1)
        if mode == "streaming"
        else None,
        expandable_segments=train.expandable_segments,
    )
    batch = p.dp * train.micro_batch_size * train.grad_accum_steps
    planner = Planner(
        model,
        train,
        cluster,
        hardware,
        world,
        batch,
        train.seq_len,
        coefficients,
        None,
        PLAN_BUDGET,
        None,
        want,
    )
    lay = Layout(world, p.tp, p.pp, p.vpp, p.cp, p.dp, p.ep)
    if not planner.micro_batches(p.dp, p.pp, p.vpp):  # the schedule's rule
        why = micro_batch_rule(p.pp_schedule, p.pp, p.vpp, train.grad_accum_steps)
        raise SpecError(
            f"grad_accum_steps: {why or 'the schedule does not run it'}; got "
            f"{train.grad_accum_steps}",
            field="grad_accum_steps",
        )
    if lay not in planner.layouts():
        why = "; ".join(planner.layout_rejections) or (
            "the model's layers, heads or experts, or the global batch, do not divide into it"
        )
        raise SpecError(f"parallel: this layout is not one its stack runs: {why}", field="parallel")
    placements = planner.placements(lay)
    if not placements:  # streaming with TP, PP or a recompute of its own
        raise SpecError(
            "offload.mode: streaming prices a layout without TP or PP and with recompute none",
            field="offload.mode",
        )
    if isinstance(train.recompute, Recompute):
        recompute = len(planner.recompute_table) - 1
    else:
        recompute = next(i for i, r in enumerate(RECOMPUTE) if r[0] == train.recompute)
    cand = Candidate(
        0.0, 0, lay, p.zero_stage, 0, train.micro_batch_size, recompute, train.expandable_segments
    )
    terms = explain_step(planner, cand)
    step = next(t.seconds for t in terms if t.term == "step")
    tokens = batch * train.seq_len / step
    flops_per_token = 6 * count_params(model).per_token_active + 12 * (
        model.num_layers * model.hidden_size * train.seq_len
    )
    return StepPrice(
        step_seconds=step,
        tokens_per_second=tokens,
        mfu=flops_per_token * tokens / (world * hardware.bf16_flops),
        gpus=world,
        global_batch=batch,
        cluster=cluster.name,
        terms=terms,
    )
