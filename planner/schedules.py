"""Pipeline schedules: what each holds in flight, its bubble, and the micro-batch counts it
runs.

The names are ``torch.distributed.pipelining``'s (``get_schedule_class``), which torchtitan's
``parallelism.pipeline_parallel_schedule`` takes: ``1F1B`` and ``GPipe`` run one stage per
rank; ``Interleaved1F1B``, ``LoopedBFS`` and ``InterleavedZeroBubble`` run ``vpp`` (virtual)
stages per rank; ``ZBVZeroBubble`` and ``DualPipeV`` two per rank in a V. Megatron-Core runs
1F1B and interleaved 1F1B (``virtual_pipeline_model_parallel_size``), DeepSpeed's
``PipelineEngine`` 1F1B only. A spec that names no schedule runs 1F1B, or interleaved 1F1B
where ``vpp`` > 1, with Megatron-Core's rule for the interleaved micro-batch count.

**In flight** (``in_flight``): the micro-batches of a stage whose activations are alive at
once, in whole micro-batches of the stage (chunks of ``1/vpp`` of its layers, rounded up), as
torch 2.13's schedules order their actions (``_calculate_single_rank_operations``; a
micro-batch's chunk is alive from its forward to its last backward: the full backward, or,
where the backward is split, the weights' backward, which keeps the graph its input backward
retained). ``tests/planner/test_schedules.py`` replays torch's own orders and finds these:

- ``1F1B``: ``min(pp - stage, m)`` (the stage's warm-up forwards and the running one).
- ``GPipe``, ``LoopedBFS``: every micro-batch, ``m`` (all forwards before any backward).
- ``Interleaved1F1B``: ``min((vpp - 1) x r + 2 (pp - 1 - stage) + 1, m x vpp)`` chunks, where
  ``r = m // max(1, m // pp)`` micro-batches make a round (``pp`` when ``m`` is a multiple of
  it, as Megatron-Core's count, which its theoretical memory reports).
- ``InterleavedZeroBubble``: ``min((vpp - 1) x r + pp, m x vpp)`` chunks on every stage (the
  first stage's count: the deferred weight backwards keep the later stages' too).
- ``ZBVZeroBubble``: ``min(2 pp, m + 1 + stage, 2 m)`` chunks.
- ``DualPipeV``: ``2 pp + 1`` chunks on every rank (its overlapped forward and backward: the
  forward's chunk is alive before the backward's is freed).

**Bubble** (``bubble_micro_batches``), in micro-batch times of the stage, with a chunk's
forward F, input backward B and weight backward W equal (a transformer's backward is twice its
forward):

- 1F1B and GPipe: ``pp - 1`` (Narayanan et al. 2021, eq. 1).
- Interleaved and looped: ``(pp - 1) / vpp`` (eq. 2); with fewer micro-batches than stages
  (one round, which cannot fill the pipeline) ``(pp - 1 + (pp - m)(vpp - 1)) / vpp``.
- The interleaved zero-bubble schedule (ZB-H1, Qi et al. 2024, arXiv:2401.10241:
  ``(pp - 1)(F + B - W)``): a third of interleaved 1F1B's. With fewer than ``pp``
  micro-batches torch's order leaves more idle than that (up to 4.5 micro-batch times at pp 8
  and one micro-batch), which is not priced.
- The V schedules (ZB-V, the same paper; DualPipeV, DeepSeek-V3's DualPipe cut to a V):
  ``(pp - 1) / 6``; ``ZBVZeroBubble`` with fewer than ``3 pp / 2`` micro-batches
  ``(2 pp - 1 - m) / 3``, where its warm-up cannot fill the V.

``tests/planner/test_schedules.py`` runs every rank's action order from torch, each action as
soon as its rank is free and its inputs are made, and finds each of these as the step beyond
the work.

**The V schedules** (``ZBVZeroBubble``, ``DualPipeV``: ``parallel.vpp`` 2) place the model in
``2 pp`` chunks, rank ``r`` holding chunks ``r`` and ``2 pp - 1 - r``
(``generate_stage_to_rank_mapping(..., style="v")``): the first rank holds the embedding and
the head, so it runs the loss (``planner.stage.stage_params``, ``v_shaped``).
"""

from __future__ import annotations

from typing import Literal, get_args

from headroom.planner.errors import SpecError

PipelineSchedule = Literal[
    "1F1B",
    "Interleaved1F1B",
    "GPipe",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
#: schedules whose fill depends on the micro-batch count (``bubble_micro_batches``)
BY_COUNT = ("ZBVZeroBubble", "Interleaved1F1B", "LoopedBFS")
#: every schedule a spec can name
SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
#: schedules of one stage per rank (``parallel.vpp`` 1)
SINGLE_STAGE = ("1F1B", "GPipe")
#: schedules of two stages per rank in a V (``parallel.vpp`` 2)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
#: schedules the estimate prices: every one
PRICED = SCHEDULES
#: the schedules each framework runs (the others run torch.distributed.pipelining's)
FRAMEWORK_SCHEDULES = {
    "megatron": ("1F1B", "Interleaved1F1B"),
    "deepspeed": ("1F1B",),
}


def schedule_of(named: str | None, vpp: int) -> str:
    """The schedule a spec runs: the one it names, else 1F1B (interleaved where vpp > 1)."""
    if named is not None:
        return named
    return "1F1B" if vpp == 1 else "Interleaved1F1B"


def _round(pp: int, grad_accum: int) -> int:
    """torch's micro-batches per round of an interleaved schedule."""
    return grad_accum // max(1, grad_accum // pp)


def in_flight(pp: int, vpp: int, stage: int, grad_accum: int, schedule: str | None = None) -> int:
    """Micro-batches of ``stage`` whose activations are alive at once (module docstring;
    ``schedule`` None: ``schedule_of``'s)."""
    schedule = schedule_of(schedule, vpp)
    if schedule in ("GPipe", "LoopedBFS"):
        return grad_accum
    if schedule == "1F1B":
        return min(pp - stage, grad_accum)
    if schedule == "ZBVZeroBubble":
        return -(-min(2 * pp, grad_accum + 1 + stage, 2 * grad_accum) // 2)
    if schedule == "DualPipeV":
        return -(-(2 * pp + 1) // 2)
    r = _round(pp, grad_accum)
    if schedule == "InterleavedZeroBubble":
        chunks = (vpp - 1) * r + pp
    else:
        chunks = (vpp - 1) * r + 2 * (pp - 1 - stage) + 1
    return -(-min(chunks, grad_accum * vpp) // vpp)


def bubble_micro_batches(
    pp: int, vpp: int, schedule: str | None = None, grad_accum: int | None = None
) -> float:
    """The pipeline's fill and drain in micro-batch times of a stage (module docstring;
    ``schedule`` None: ``schedule_of``'s; ``grad_accum`` None: enough micro-batches to fill
    it)."""
    schedule = schedule_of(schedule, vpp)
    if schedule in ("1F1B", "GPipe"):
        return float(pp - 1)
    if schedule in V_SHAPED:
        steady = (pp - 1) / 6
        if schedule == "ZBVZeroBubble" and grad_accum is not None:
            return max(steady, (2 * pp - 1 - grad_accum) / 3)
        return steady
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) / (3 * vpp)
    if grad_accum is not None and grad_accum < pp:  # one round that cannot fill the pipeline
        return (pp - 1 + (pp - grad_accum) * (vpp - 1)) / vpp
    return (pp - 1) / vpp


def micro_batch_rule(named: str | None, pp: int, vpp: int, grad_accum: int) -> str | None:
    """Why ``grad_accum`` micro-batches are not a count the schedule runs (None: it runs
    them). Named schedules are torch's: 1F1B needs at least ``pp``; the interleaved ones a
    count a round divides (``ScheduleInterleaved1F1B``: ``m % max(1, m // pp) == 0``);
    DualPipeV at least its ``2 x pp`` stages. A spec that names none and interleaves is
    Megatron-Core's: a count ``pp`` divides."""
    if pp == 1:
        return None
    if named is None:
        # Megatron-Core's interleaved schedule refuses a micro-batch count the pipeline
        # size does not divide. megatron/core/pipeline_parallel/schedules.py,
        # forward_backward_pipelining_with_interleaving (NVIDIA/Megatron-LM 2e2bdf62):
        #     if num_microbatches % pipeline_parallel_size != 0:
        #         msg = f'number of microbatches ({num_microbatches}) is not divisible by '
        #         msg += f'pipeline-model-parallel-size ({pipeline_parallel_size}) '
        #         msg += 'when using interleaved schedule'
        #         raise RuntimeError(msg)
        # Since 4295be1a the check reads microbatch_group_size_per_vp_stage, which
        # ModelParallelConfig.__post_init__ sets to pipeline_model_parallel_size (d98e8a64):
        #     if (config.microbatch_group_size_per_vp_stage > num_microbatches
        #         or config.microbatch_group_size_per_vp_stage < pipeline_parallel_size):
        #         raise ValueError(msg)
        #     final_microbatch_group_size = num_microbatches % config.microbatch_group_...
        #     if 0 < final_microbatch_group_size < pipeline_parallel_size: raise ...
        # i.e. still a count divisible by pp. torch.distributed.pipelining's
        # ScheduleInterleaved1F1B (torchtitan) runs such counts too.
        if vpp > 1 and grad_accum % pp:
            return (
                f"the interleaved schedule (parallel.vpp {vpp}) runs a micro-batch count that "
                f"parallel.pp ({pp}) divides, as Megatron-Core checks it"
            )
        return None
    if named == "1F1B" and grad_accum < pp:
        return f"1F1B runs at least parallel.pp ({pp}) micro-batches, as torch checks it"
    if named in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, grad_accum // pp)
        if grad_accum % rounds:
            return (
                f"{named} runs a micro-batch count its rounds ({rounds} of parallel.pp "
                f"{pp}) divide, as torch checks it"
            )
    if named == "DualPipeV" and grad_accum < 2 * pp:
        return f"DualPipeV runs at least its 2 x parallel.pp ({2 * pp}) stages' micro-batches"
    return None


def check_schedule(named: str | None, framework: str, vpp: int, pp: int) -> None:
    """A SpecError naming ``parallel.pp_schedule`` where the framework does not run the
    schedule or its stages per rank are not ``vpp`` (a V schedule without a pipeline, ``pp``
    1, is one stage: ``vpp`` 1 or 2)."""
    if named is None:
        return
    runs = FRAMEWORK_SCHEDULES.get(framework)
    if runs is not None and named not in runs:
        raise SpecError(
            f"parallel.pp_schedule: framework {framework} runs {' and '.join(runs)}; allowed: "
            f"{', '.join(runs)}, got {named}",
            field="parallel.pp_schedule",
        )
    if named in SINGLE_STAGE and vpp != 1:
        raise SpecError(
            f"parallel.pp_schedule: {named} runs one stage per rank, so parallel.vpp must be 1, "
            f"got {vpp}; with more: " + ", ".join(s for s in SCHEDULES if s not in SINGLE_STAGE),
            field="parallel.pp_schedule",
        )
    if named in V_SHAPED and vpp != 2 and not (pp == 1 and vpp == 1):
        raise SpecError(
            f"parallel.pp_schedule: {named} runs two model chunks per rank in a V, so "
            f"parallel.vpp must be 2, got {vpp}",
            field="parallel.pp_schedule",
        )
