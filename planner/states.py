"""Persistent state of one pipeline stage's rank: parameters, gradients, master weights,
optimizer moments, EMA and transfer buffers, on the GPU and in host RAM.

These terms depend on the placement (parallel layout, ZeRO stage, precisions, optimizer,
offload), not on the batch shape, so a search that varies only the batch shape reuses them:
``planner.estimator`` memoises ``model_states`` by its ``StatesInputs``.
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner import buckets as b
from headroom.planner.model import ModelSpec
from headroom.planner.stage import (
    UNIT_DENSE,
    UNIT_EMBED,
    UNIT_HEAD,
    UNIT_MOE,
    PerKind,
    StageParams,
    offloaded_numel,
    stage_bytes,
    stage_params,
)


class StatesInputs(NamedTuple):
    """Everything ``model_states`` reads besides the model and the stage (also its cache key)."""

    tp: int
    pp: int
    ep: int
    data_parallel: int  # dp x cp: the group dense tensors shard over
    zero_stage: int
    param_bytes: int  # bytes per working parameter
    grad_bytes: int  # bytes per gradient (+ the working-precision one with fp32 accumulation)
    master_bytes: int  # bytes per master parameter
    state_bytes: int  # bytes per optimizer-state element
    optimizer: str
    optimizer_impl: str
    ema: str  # none | gpu | host
    offload_mode: str  # none | optimizer | streaming
    offload_fraction: float  # share of the optimizer offloaded (0 unless mode is optimizer)
    num_buffers: int  # streaming's layer buffers (0 unless streaming)
    accumulating: bool  # gradient accumulation over more than one micro-batch
    backward_mlp_grads: float  # coefficient: share of its MLP's gradients a layer holds at
    # the peak of its MLP's backward
    framework: str = "none"  # none | fsdp2
    reshard_after_forward: bool = True  # fsdp2: blocks gathered again for their backward
    fsdp2_groups: str = "root"  # fsdp2: root (one group with the embedding, norm and head)
    # or split (the embedding alone, the norm with the head)
    reduce_bytes: int = 4  # fsdp2: bytes per element of a reduce-scatter's input
    deepspeed: tuple[int, ...] = ()  # deepspeed: ``planner.estimator.deepspeed_knobs``
    distributed_optimizer: bool = True  # megatron: master weights and moments over dp x cp
    # fsdp2 with tp > 1: the embedding's backward makes the whole vocabulary's gradient
    # (``Coefficients.embedding_grad_whole_vocab``)
    embedding_grad_whole_vocab: bool = True
    # torchtune's optimizer_in_bwd: each parameter stepped and its gradient freed as it lands
    optimizer_in_backward: bool = False
    # a V schedule's placement (``planner.stage.v_chunks``): the first rank holds the head
    v_shaped: bool = False


class ZeroShards(NamedTuple):
    """How many ways ZeRO splits each kind of state (1: not split)."""

    params: int  # ZeRO-3
    grads: int  # ZeRO-2 and up
    optimizer: int  # ZeRO-1 and up: master weights, moments and EMA


class HostBytes(NamedTuple):
    """Host RAM of one rank, per bucket (``HOST_BUCKETS`` order)."""

    params: int
    grads: int
    master_params: int
    optimizer_states: int
    ema: int
    transfer_buffers: int


class LayerGrads(NamedTuple):
    """One layer's gradients as its backward makes them (all 0: already live or streamed)."""

    layer: int  # all of the layer's, once its backward is done
    mlp_peak: int  # at the peak of its MLP's backward (a share of ``mlp``)
    mlp: int  # all of its MLP's (an MoE layer's: all its experts'), once the MLP's is done
    start: int  # as its routed experts' backward starts: an MoE layer's shared experts', which
    # forward computed last and backward makes first (a dense layer: 0)


class ModelStates(NamedTuple):
    """Persistent bytes of one stage's rank and the gradients' timeline through backward."""

    stage_params: StageParams  # the stage's local parameter facts they were computed from
    zero_dense: ZeroShards  # how ZeRO splits the dense tensors' states
    zero_expert: ZeroShards  # the routed experts' (over the expert-data-parallel group)
    offloaded_numel: int  # elements whose optimizer update runs on the host
    gpu_updated_numel: int  # elements whose optimizer update runs on the GPU
    params: int
    grads_total: int  # every gradient buffer of the stage
    grads_start: int  # as the layers' backward starts: the head's, a tied table's pending
    # gradient, or all of them when accumulating
    layer_grads: PerKind[LayerGrads]  # a dense and an MoE layer's, made during backward
    grads_tail: int  # at the embedding's backward: its gradient being made and accumulated
    master_params: int
    optimizer_states: int
    optimizer_temporaries: int  # the optimizer step's own
    ema: int
    transfer_buffers: int  # at the backward's end (the ``grads_tail`` point; ZeRO-3: the
    # gathered units)
    forward_transfer: int  # through forward
    loss_transfer: int  # at the loss's backward
    layer_transfer: tuple[int, int, int, int]  # at a layer's backward, by the layer's edge
    # (middle, bottom, top, the only layer: ``planner.activations.BackwardPoint.edge``)
    released_transfer: tuple[int, int]  # less per dense and MoE layer above the running one
    grads_resident: bool  # the gradient buffers exist from the start (Megatron's contiguous
    # buffer), not only as backward makes them
    host: HostBytes
    # (grads, transfer_buffers) as the head's own group is reduced right after the loss's
    # backward, every saved activation still held (FSDP2's split grouping); None: no such point
    head_reduced: tuple[int, int] | None = None
    # the gradients the optimizer step reads where fewer than ``grads_total`` (FSDP2 under
    # pipelining: the shards the step-end reduction leaves; None: ``grads_total``)
    step_grads: int | None = None


def states_bytes(states: ModelStates) -> int:
    """An upper bound of the bytes ``states`` holds (its stage's facts included): a cache
    entry's weight (``planner._memo``)."""
    return 4096 + stage_bytes(states.stage_params)


def _zero_shards(group: int, zero_stage: int) -> ZeroShards:
    return ZeroShards(
        params=group if zero_stage >= 3 else 1,
        grads=group if zero_stage >= 2 else 1,
        optimizer=group if zero_stage >= 1 else 1,
    )


_NO_LAYER_GRADS = LayerGrads(layer=0, mlp_peak=0, mlp=0, start=0)


def _stepped_in_backward(
    sp: StageParams,
    inputs: StatesInputs,
    grads_split: int,
    grad_bytes: int,
    autograd_bytes: int,
    master_bytes: int,
    zero_dense: ZeroShards,
) -> tuple[int, PerKind[LayerGrads], int, int]:
    """(gradients as the layers' backward starts, a layer's, at the embedding's backward, the
    step's temporaries) when the optimizer steps in the backward (torchtune's
    ``optimizer_in_bwd``: ``torchtune/training/memory.py``, each parameter's
    ``register_post_accumulate_grad_hook`` runs its own optimizer's ``step()`` and
    ``zero_grad()``). No gradient outlives its parameter's step: at any moment one
    parameter's gradient exists, at most the largest, with its step's temporaries (the step
    runs on that one tensor). A tied table's head gradient still waits in autograd's input
    buffer for the embedding's (the hook fires once ``.grad`` is whole), and the embedding's
    backward makes its table beside it. The step's temporaries are counted in the backward's
    gradients, beside the one gradient they exist with."""
    largest = sp.largest_tensor_numel
    one_grad = b.grads_bytes(largest, grad_bytes, grads_split)
    local = -(-largest // zero_dense.optimizer)
    temp = b.optimizer_temporary_bytes(
        inputs.optimizer,
        inputs.optimizer_impl,
        local,
        local,
        min(sp.largest_matrix_numel, largest),
        inputs.state_bytes,
        4 if (master_bytes == 4 and grad_bytes < 4) else 0,
        mixed_states=master_bytes == 4 and inputs.state_bytes < 4,
    )
    start = one_grad + temp
    table = b.grads_bytes(sp.embedding_numel, autograd_bytes, grads_split)
    waiting = table if sp.tied_embeddings else 0
    tail = start + waiting
    if sp.has_embedding:
        # the embedding's new table (and, tied, the sum of the two), then its step
        tail = max(tail, waiting + table * (2 if sp.tied_embeddings else 1) + temp)
    none = PerKind(dense=_NO_LAYER_GRADS, moe=_NO_LAYER_GRADS)
    return start + waiting, none, tail, temp


def model_states(model: ModelSpec, stage: int, inputs: StatesInputs) -> ModelStates:
    """Persistent state of ``stage``'s rank under ``inputs``."""
    sp = stage_params(model, inputs.tp, inputs.pp, inputs.ep, stage, inputs.v_shaped)
    if inputs.framework == "fsdp2":
        return fsdp2_states(sp, inputs)
    if inputs.framework == "deepspeed":
        return deepspeed_states(sp, inputs)
    if inputs.framework == "megatron":
        return megatron_states(sp, inputs)
    streaming = inputs.offload_mode == "streaming"
    param_bytes, grad_bytes, master_bytes = (
        inputs.param_bytes,
        inputs.grad_bytes,
        inputs.master_bytes,
    )
    state_bytes, optimizer, ema = inputs.state_bytes, inputs.optimizer, inputs.ema
    accumulating = inputs.accumulating
    if streaming:
        # host holds every persistent byte; ZeRO has nothing to shard on the GPU. The bundled
        # trainer's data-parallel ranks each keep a piece of every unit's master, moments and
        # EMA (their working copies and gradient accumulators whole), so a node holds one
        # copy of the optimizer's state
        shards = ZeroShards(params=1, grads=1, optimizer=inputs.data_parallel)
        zero_dense = zero_expert = shards
    else:
        zero_dense = _zero_shards(inputs.data_parallel, inputs.zero_stage)
        zero_expert = _zero_shards(inputs.data_parallel // inputs.ep, inputs.zero_stage)
    dense, expert = sp.dense_numel, sp.expert_numel

    # Model states, local shard, before placement: dense tensors shard over dp x cp, experts
    # over the expert-data-parallel group.
    opt_total = _optimizer_bytes(
        sp, optimizer, state_bytes, zero_dense.optimizer, zero_expert.optimizer
    )
    local_opt_numel = _partition(sp, zero_dense.optimizer, zero_expert.optimizer)
    master_total = b.master_params_bytes(
        dense, master_bytes, zero_dense.optimizer
    ) + b.master_params_bytes(expert, master_bytes, zero_expert.optimizer)
    ema_total = (
        b.ema_bytes(dense, zero_dense.optimizer) + b.ema_bytes(expert, zero_expert.optimizer)
        if ema != "none"
        else 0
    )

    # bytes of a gradient as autograd produces it (fp32 accumulation adds a buffer to it)
    autograd_bytes = param_bytes if grad_bytes > param_bytes else grad_bytes
    if streaming:
        # the device holds autograd's gradients only; the fp32 accumulator is the host's
        unit = sp.max_unit_numel
        numel = dense + expert
        unit_grads = unit * autograd_bytes
        return ModelStates(
            stage_params=sp,
            zero_dense=zero_dense,
            zero_expert=zero_expert,
            offloaded_numel=local_opt_numel,
            gpu_updated_numel=0,
            params=inputs.num_buffers * unit * param_bytes,
            grads_total=unit_grads,
            grads_start=unit_grads,
            # the layers' gradients land in the one unit counted
            layer_grads=PerKind(dense=_NO_LAYER_GRADS, moe=_NO_LAYER_GRADS),
            grads_tail=unit_grads,
            master_params=0,
            optimizer_states=0,
            optimizer_temporaries=0,
            ema=0,
            transfer_buffers=2 * unit_grads,  # gradient slabs draining to the host
            forward_transfer=2 * unit_grads,
            loss_transfer=0,  # the head runs before any gradient slab drains
            layer_transfer=(2 * unit_grads,) * 4,
            released_transfer=(0, 0),
            grads_resident=False,
            host=HostBytes(
                params=numel * param_bytes,
                grads=numel * 4,
                master_params=master_total,
                optimizer_states=opt_total,
                ema=ema_total,
                transfer_buffers=2 * unit * grad_bytes,
            ),
        )

    grads_split = zero_dense.grads
    params = b.params_bytes(dense, param_bytes, zero_dense.params) + b.params_bytes(
        expert, param_bytes, zero_expert.params
    )
    grads_total = b.grads_bytes(dense, grad_bytes, grads_split) + b.grads_bytes(
        expert, grad_bytes, zero_expert.grads
    )
    if inputs.offload_mode == "optimizer":
        off_dense, off_expert = offloaded_numel(
            sp, zero_dense.optimizer, zero_expert.optimizer, inputs.offload_fraction
        )
        offloaded = off_dense + off_expert
    else:
        offloaded = 0
    gpu_updated = local_opt_numel - offloaded
    opt = int(opt_total * (gpu_updated / local_opt_numel)) if local_opt_numel else 0
    opt_temp = (
        b.optimizer_temporary_bytes(
            optimizer,
            inputs.optimizer_impl,
            gpu_updated,
            sp.largest_tensor_numel,
            sp.largest_matrix_numel,
            state_bytes,
            4 if (master_bytes == 4 and grad_bytes < 4) else 0,
            mixed_states=master_bytes == 4 and state_bytes < 4,
        )
        if gpu_updated
        else 0
    )
    # ZeRO-3 gathers full layers around compute: the layer in use and the one prefetched.
    gathered = inputs.zero_stage >= 3 and inputs.data_parallel > 1
    transfer = 2 * (sp.max_unit_numel * param_bytes) if gathered else 0
    if accumulating:  # every gradient buffer is live from the first micro-batch on
        grads_start = grads_total
        layer_grads = PerKind(dense=_NO_LAYER_GRADS, moe=_NO_LAYER_GRADS)
    else:
        grads_start = (
            b.grads_bytes(sp.head_unit_numel, grad_bytes, grads_split) if sp.has_head else 0
        )
        expert_grads = b.grads_bytes(sp.moe_layer_expert_numel, grad_bytes, zero_expert.grads)
        shared_grads = b.grads_bytes(sp.moe_layer_shared_numel, grad_bytes, grads_split)
        # a layer's backward makes its MLP's gradients first: a share of them exists at the
        # peak of the MLP's backward, all of them once it is done
        mlp_dense = b.grads_bytes(sp.dense_layer_mlp_numel, grad_bytes, grads_split)
        mlp_moe = shared_grads + expert_grads
        share = inputs.backward_mlp_grads
        layer_grads = PerKind(
            dense=LayerGrads(
                layer=b.grads_bytes(sp.dense_layer_numel, grad_bytes, grads_split),
                mlp_peak=int(share * mlp_dense),
                mlp=mlp_dense,
                start=0,
            ),
            moe=LayerGrads(
                layer=b.grads_bytes(sp.moe_layer_numel, grad_bytes, grads_split) + expert_grads,
                mlp_peak=int(share * mlp_moe),
                mlp=mlp_moe,
                start=shared_grads,
            ),
        )
    if sp.tied_embeddings:
        # the head's gradient of a tied table waits in autograd's input buffer for the
        # embedding's through every layer's backward (the tail below adds the two)
        grads_start += b.grads_bytes(sp.embedding_numel, autograd_bytes, grads_split)
    if sp.has_embedding:
        embedding_grad = b.grads_bytes(sp.embedding_numel, grad_bytes, grads_split)
        # The embedding's backward makes a new table-sized gradient. A tied table already
        # holds the head's contribution in autograd's input buffer, and the engine adds the
        # two out of place (measured: three tables at once, on real and fake tensors);
        # accumulation adds into the existing .grad, one more table alive at that moment.
        # Those tables are autograd's (working precision); an fp32 accumulator of the
        # embedding is made when its gradient lands, after them, unless accumulating.
        tables = 2 * int(sp.tied_embeddings) + int(accumulating)
        working_table = b.grads_bytes(sp.embedding_numel, autograd_bytes, grads_split)
        late = 0 if accumulating else embedding_grad - working_table
        grads_tail = grads_total - late + working_table * tables
    else:
        grads_tail = grads_total
    step_grads = None
    if inputs.optimizer_in_backward:
        grads_start, layer_grads, grads_tail, opt_temp = _stepped_in_backward(
            sp, inputs, grads_split, grad_bytes, autograd_bytes, master_bytes, zero_dense
        )
        step_grads = 0
    ema_total_gpu = ema_total if ema == "gpu" else 0
    # the bundled trainer's data-parallel ranks (no ZeRO stage of their own) each keep a piece
    # of every offloaded tensor's fp32 gradient, master and moments (reduce-scattered,
    # updated, all-gathered), so a node holds one copy of the offloaded state
    pieces = 1
    if offloaded and inputs.framework == "none" and inputs.zero_stage == 0:
        pieces = inputs.data_parallel
    return ModelStates(
        stage_params=sp,
        zero_dense=zero_dense,
        zero_expert=zero_expert,
        offloaded_numel=offloaded,
        gpu_updated_numel=gpu_updated,
        params=params,
        grads_total=grads_total,
        grads_start=grads_start,
        layer_grads=layer_grads,
        grads_tail=grads_tail,
        master_params=gpu_updated * master_bytes,
        optimizer_states=opt,
        optimizer_temporaries=opt_temp,
        ema=ema_total_gpu,
        transfer_buffers=transfer,
        forward_transfer=transfer,
        loss_transfer=transfer,
        layer_transfer=(transfer,) * 4,
        released_transfer=(0, 0),
        grads_resident=False,
        step_grads=step_grads,
        host=HostBytes(
            params=0,
            grads=-(-offloaded * 4 // pieces),
            master_params=-(-offloaded * master_bytes // pieces),
            optimizer_states=-(-(opt_total - opt) // pieces),
            ema=ema_total if ema == "host" else 0,
            transfer_buffers=0,
        ),
    )


def _optimizer_bytes(
    sp: StageParams, optimizer: str, state_bytes: int, over_dense: int, over_expert: int
) -> int:
    """The optimizer's state of the stage's dense tensors sharded over ``over_dense`` ranks and
    of its experts over ``over_expert``."""
    return b.optimizer_state_bytes(
        optimizer,
        sp.dense_numel,
        state_bytes,
        matrix_numel=sp.matrix_dense_numel,
        adafactor_numel=sp.adafactor_dense_numel,
        adam8bit_bytes=sp.adam8bit_dense_bytes,
        zero1_shards=over_dense,
    ) + b.optimizer_state_bytes(
        optimizer,
        sp.expert_numel,
        state_bytes,
        matrix_numel=sp.matrix_expert_numel,
        adafactor_numel=sp.adafactor_expert_numel,
        adam8bit_bytes=sp.adam8bit_expert_bytes,
        zero1_shards=over_expert,
    )


def _running_layer_grads(
    sp: StageParams,
    inputs: StatesInputs,
    layer_dense: int,
    layer_moe: int,
    whole_layer: bool = False,
) -> PerKind[LayerGrads]:
    """A framework's gradients through one layer's backward: a layer above holds
    ``layer_dense`` or ``layer_moe`` (reduced or sharded already; 0 when accumulating: the
    buffers are live), the running layer makes its own whole in the working precision (the
    profile's ``backward_mlp_grads`` share of its MLP's at the MLP's peak). ``whole_layer``:
    the point after the MLP's backward is the layer's end, all of its gradients made (FSDP2's
    unsharded gradients wait for the block's post-backward)."""
    param_bytes, share = inputs.param_bytes, inputs.backward_mlp_grads
    accumulating = inputs.accumulating
    mlp_dense = sp.dense_layer_mlp_numel * param_bytes
    shared = sp.moe_layer_shared_numel * param_bytes
    mlp_moe = shared + sp.moe_layer_expert_numel * param_bytes
    end_dense, end_moe = mlp_dense, mlp_moe
    if whole_layer and not accumulating:
        end_dense = sp.dense_layer_numel * param_bytes
        end_moe = (sp.moe_layer_numel + sp.moe_layer_expert_numel) * param_bytes
    return PerKind(
        dense=LayerGrads(
            layer=0 if accumulating else layer_dense,
            mlp_peak=int(share * mlp_dense),
            mlp=end_dense,
            start=0,
        ),
        moe=LayerGrads(
            layer=0 if accumulating else layer_moe,
            mlp_peak=int(share * mlp_moe),
            mlp=end_moe,
            start=shared,
        ),
    )


def _step_temporaries(
    sp: StageParams, inputs: StatesInputs, numel: int, largest: int, largest_matrix: int
) -> int:
    """The optimizer step's temporaries over ``numel`` elements updated on the GPU, whose
    gradients are in the master's precision already (no upcast copy)."""
    if not numel:
        return 0
    return b.optimizer_temporary_bytes(
        inputs.optimizer,
        inputs.optimizer_impl,
        numel,
        largest,
        largest_matrix,
        inputs.state_bytes,
        0,
        mixed_states=(inputs.master_bytes or inputs.param_bytes) == 4 and inputs.state_bytes < 4,
    )


def _offloaded_host(
    inputs: StatesInputs, offloaded: int, opt_total: int, opt: int, ema_total: int
) -> HostBytes:
    """Host RAM of a framework's optimizer offload: the offloaded share's fp32 gradients,
    master weights and moments, and a host EMA."""
    return HostBytes(
        params=0,
        grads=offloaded * 4,
        master_params=offloaded * inputs.master_bytes,
        optimizer_states=opt_total - opt,
        ema=ema_total if inputs.ema == "host" else 0,
        transfer_buffers=0,
    )


def _partition(sp: StageParams, over_dense: int, over_expert: int) -> int:
    """Elements of the rank's partition: the stage's dense tensors split over ``over_dense``
    ranks, its experts over ``over_expert``."""
    return -(-sp.dense_numel // over_dense) + -(-sp.expert_numel // over_expert)


def fsdp2_states(sp: StageParams, inputs: StatesInputs) -> ModelStates:
    """Persistent state of one stage's rank under FSDP2 as torchtitan applies it:
    ``fully_shard`` on every decoder layer and on the root (the embedding, final norm and head),
    ``MixedPrecisionPolicy(param_dtype=precision.params, reduce_dtype=precision.grads)``.

    Read from ``torch/distributed/fsdp/_fully_shard`` (``_fsdp_param_group.py``,
    ``_fsdp_collectives.py``) and the categories of FSDP2 traces
    (``calibration/frameworks/fsdp2.py``):

    - the parameters are sharded only, in ``precision.master`` (fp32): there is no separate
      master copy; gradients are sharded in the same dtype once reduce-scattered;
    - the root is gathered (``param_dtype``) from the first forward to its post-backward at
      the end of backward; a block is gathered for its forward and, resharded after it, again
      for its backward; the next block is prefetched while one runs (none below the bottom);
      the last all-gather's block is held through the loss;
    - a block's backward makes its gradients unsharded in ``param_dtype``; its post-backward
      copies them into a reduce-scatter input in ``reduce_dtype``, held until the next
      block's post-backward (so under every block's backward but the top's);
    - the backward ends at the larger of the embedding's backward (a table-sized gradient;
      under tensor parallelism, where the model code runs a DTensor embedding, the whole
      vocabulary's, beside the local table's) and the
      root's post-backward (its gradients and their reduce-scatter input).
    """
    dp, ep = inputs.data_parallel, inputs.ep
    zero_dense, zero_expert = _zero_shards(dp, 3), _zero_shards(dp // ep, 3)
    over_dense, over_expert = dp, max(1, dp // ep)
    param_bytes, state_bytes = inputs.param_bytes, inputs.state_bytes
    shard_bytes = inputs.master_bytes or param_bytes
    local_numel = _partition(sp, over_dense, over_expert)
    params = local_numel * shard_bytes
    grads_total = params  # the sharded gradients, in the shards' dtype
    opt = _optimizer_bytes(sp, inputs.optimizer, state_bytes, over_dense, over_expert)
    opt_temp = _step_temporaries(
        sp,
        inputs,
        local_numel,
        -(-sp.largest_tensor_numel // over_dense),
        -(-sp.largest_matrix_numel // over_dense),
    )
    ema_total = local_numel * 4 if inputs.ema != "none" else 0

    # gathered units: the root (embedding, final norm, head) and a block of each kind
    table_numel = sp.embedding_numel if sp.has_embedding else 0
    head_numel = sp.head_unit_numel if sp.has_head else 0
    units = _fsdp2_units(sp, inputs)
    step_grads = None
    layer_grads = _running_layer_grads(
        sp, inputs, units.layer_dense, units.layer_moe, whole_layer=True
    )
    if inputs.pp > 1:
        # torch's pipelining reduces once a step: the unsharded gradients accumulate
        stage_numel = (
            units.n_dense * units.dense + units.n_moe * units.moe + table_numel + head_numel
        )
        if sp.tied_embeddings and sp.has_embedding and sp.has_head:
            stage_numel -= head_numel  # one table
        timeline = _fsdp2_pipelined(stage_numel, inputs)
        step_grads, grads_total = grads_total, timeline.grads_start
        layer_grads = _running_layer_grads(sp, inputs, 0, 0, whole_layer=True)
    elif inputs.fsdp2_groups == "split":
        if sp.tied_embeddings:  # one group, gathered again for the embedding's backward
            table_numel = head_numel = table_numel + head_numel
        timeline = _fsdp2_split(sp, inputs, units, table_numel, head_numel, grads_total)
    else:
        timeline = _fsdp2_root(sp, inputs, units, table_numel + head_numel, grads_total)
    return ModelStates(
        stage_params=sp,
        zero_dense=zero_dense,
        zero_expert=zero_expert,
        offloaded_numel=0,
        gpu_updated_numel=local_numel,
        params=params,
        grads_total=grads_total,
        grads_start=timeline.grads_start,
        layer_grads=layer_grads,
        grads_tail=timeline.grads_tail,
        master_params=0,
        optimizer_states=opt,
        optimizer_temporaries=opt_temp,
        ema=ema_total if inputs.ema == "gpu" else 0,
        transfer_buffers=timeline.transfer_buffers,
        forward_transfer=timeline.forward_transfer,
        loss_transfer=timeline.loss_transfer,
        layer_transfer=timeline.layer_transfer,
        released_transfer=timeline.released_transfer,
        grads_resident=False,
        host=HostBytes(0, 0, 0, 0, ema_total if inputs.ema == "host" else 0, 0),
        head_reduced=timeline.head_reduced,
        step_grads=step_grads,
    )


def _fsdp2_pipelined(stage_numel: int, inputs: StatesInputs) -> _Fsdp2Timeline:
    """``fsdp2_states``' timeline of a pipeline stage (``parallel.pp`` > 1) as torch's
    pipelining runs FSDP2 (``torch/distributed/pipelining/stage.py``): every micro-batch's
    backward runs with ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)``, and ``perform_reduce_grad`` reduces once, after the
    step's last backward. So from the step's first backward on, every group of the stage is
    gathered (``param_dtype``) and its gradients accumulate unsharded, in ``reduce_dtype``
    where it differs (``FSDPParam.unsharded_accumulated_grad``), until the step's end; the
    running block's own gradients are made beside them. (torchtitan also leaves
    ``reshard_after_forward`` off under pipelining, its ``default`` policy: the groups stay
    gathered from their first forward.) The optimizer then reads the shards."""
    gathered = stage_numel * inputs.param_bytes
    accumulated = stage_numel * max(inputs.reduce_bytes, inputs.param_bytes)
    return _Fsdp2Timeline(
        grads_start=accumulated,
        grads_tail=accumulated,
        transfer_buffers=gathered,
        forward_transfer=gathered,
        loss_transfer=gathered,
        layer_transfer=(gathered,) * 4,
        released_transfer=(0, 0),
        head_reduced=None,
    )


class _Fsdp2Timeline(NamedTuple):
    """What FSDP2 holds through one step beyond the sharded state (``ModelStates``' fields of
    the same names)."""

    grads_start: int
    grads_tail: int
    transfer_buffers: int
    forward_transfer: int
    loss_transfer: int
    layer_transfer: tuple[int, int, int, int]
    released_transfer: tuple[int, int]
    head_reduced: tuple[int, int] | None


class _Fsdp2Units(NamedTuple):
    """A stage's blocks as FSDP2 gathers and reduces them."""

    dense: int  # elements of a dense block
    moe: int  # of an MoE block
    n_dense: int
    n_moe: int
    unit: int  # the largest block's elements
    layer_dense: int  # a dense block's sharded gradients (bytes)
    layer_moe: int  # an MoE block's
    layers_sharded: int  # every block's sharded gradients (bytes)


def _fsdp2_units(sp: StageParams, inputs: StatesInputs) -> _Fsdp2Units:
    over_dense, over_expert = inputs.data_parallel, max(1, inputs.data_parallel // inputs.ep)
    shard_bytes = inputs.master_bytes or inputs.param_bytes
    dense = sp.dense_layer_numel
    moe = sp.moe_layer_numel + sp.moe_layer_expert_numel
    n_moe = sp.num_moe_layers
    n_dense = sp.num_layers - n_moe
    layer_dense = -(-dense // over_dense) * shard_bytes
    layer_moe = (
        -(-sp.moe_layer_numel // over_dense) * shard_bytes
        + -(-sp.moe_layer_expert_numel // over_expert) * shard_bytes
    )
    return _Fsdp2Units(
        dense=dense,
        moe=moe,
        n_dense=n_dense,
        n_moe=n_moe,
        unit=max(dense if n_dense else 0, moe if n_moe else 0),
        layer_dense=layer_dense,
        layer_moe=layer_moe,
        layers_sharded=n_dense * layer_dense + n_moe * layer_moe,
    )


def _fsdp2_root(
    sp: StageParams, inputs: StatesInputs, u: _Fsdp2Units, root: int, grads_total: int
) -> _Fsdp2Timeline:
    """``fsdp2_states``' timeline with the root's one group (its docstring)."""
    param_bytes, reduce_bytes = inputs.param_bytes, inputs.reduce_bytes
    dense_unit, moe_unit, n_dense, n_moe, unit = u.dense, u.moe, u.n_dense, u.n_moe, u.unit
    root_gathered, unit_gathered = root * param_bytes, unit * param_bytes
    reduce_input = unit * reduce_bytes  # a block's reduce-scatter input
    if inputs.reshard_after_forward:
        # the block running, the one prefetched below it, the last all-gather's through the
        # loss
        forward = loss = root_gathered + unit_gathered
        middle = root_gathered + 2 * unit_gathered
        bottom = middle - unit_gathered  # nothing to prefetch below the bottom block
        top = middle
        released = (0, 0)
    else:
        # every block stays gathered from its forward until its backward is done; the last
        # all-gather's output is held through the forward too
        gathered = root_gathered + (n_dense * dense_unit + n_moe * moe_unit) * param_bytes
        forward, loss = gathered + unit_gathered, gathered
        middle = bottom = top = gathered
        released = (dense_unit * param_bytes, moe_unit * param_bytes)
    # by edge: the layer above's reduce-scatter input is held under all but the top block
    layer_transfer = (middle + reduce_input, bottom + reduce_input, top, bottom)
    accumulating = inputs.accumulating
    # the head's gradients (a tied table's too) wait unsharded for the root's post-backward
    head_grads = sp.head_unit_numel * param_bytes if sp.has_head else 0
    table = sp.embedding_numel * param_bytes
    if sp.tied_embeddings:
        head_grads += table
    live = grads_total if accumulating else 0
    grads_start = live + head_grads
    done = grads_total if accumulating else u.layers_sharded
    # the root's post-backward: its parameters resharded, its gradients and their
    # reduce-scatter input
    tail_grads, tail_transfer = done + root * param_bytes, root * reduce_bytes
    if sp.has_embedding:
        # the embedding's backward: a table-sized gradient (:func:`_embedding_grad`), added
        # out of place to a tied head's;
        # the root gathered, the bottom block's reduce-scatter input held
        made = _embedding_grad(inputs, table) + table * int(sp.tied_embeddings)
        embedding = (done + head_grads + made, root_gathered + (reduce_input if unit else 0))
        if sum(embedding) > tail_grads + tail_transfer:
            tail_grads, tail_transfer = embedding
    return _Fsdp2Timeline(
        grads_start=grads_start,
        grads_tail=tail_grads,
        transfer_buffers=tail_transfer,
        forward_transfer=forward,
        loss_transfer=loss,
        layer_transfer=layer_transfer,
        released_transfer=released,
        head_reduced=None,
    )


def _embedding_grad(inputs: StatesInputs, table: int) -> int:
    """Bytes the embedding's backward makes of ``table`` bytes of local table: under tensor
    parallelism, where the model code runs a DTensor embedding, the whole vocabulary's
    gradient beside the local table's; else the local table's."""
    if inputs.tp > 1 and inputs.embedding_grad_whole_vocab:
        return table * (inputs.tp + 1)
    return table


def _fsdp2_split(
    sp: StageParams,
    inputs: StatesInputs,
    u: _Fsdp2Units,
    table_numel: int,
    head_numel: int,
    grads_total: int,
) -> _Fsdp2Timeline:
    """``fsdp2_states`` under torchtitan 0.3's grouping (``apply_fsdp_to_decoder``, an untied
    table): the embedding a group of its own, resharded after forward as the blocks are; the
    final norm with the head one group, not resharded after forward. Read from FSDP2's code as
    the root grouping is, and from traces of torchtitan's own model under it
    (``calibration/frameworks/fsdp2.py``): FSDP2 keeps the last all-gather's output until the
    next all-gather and the last reduce-scatter's input until the next reduce-scatter, so

    - the loss runs with the head's group gathered, no embedding and no block;
    - as the loss's backward ends the head's group is reduced: its reduce-scatter input
      (``reduce_dtype``) beside the group and a group-sized all-gather output, every saved
      activation still held, the head's gradients sharded from then on;
    - a block's backward holds the block, the one below prefetched (under the bottom block the
      embedding) and the reduce-scatter input of the block above; the top block's, the head's
      input released, holds the block and either the one below or its own reduce-scatter
      input (the larger is counted);
    - a tied table's group (embedding, norm and head) stays gathered through the loss, is
      reduced after the loss's backward and gathered again for the embedding's backward;
    - the backward ends at the larger of the embedding's backward (the table gathered, its
      gradient made, the bottom block's reduce-scatter input) and its post-backward (its
      gradient and its reduce-scatter input)."""
    param_bytes, reduce_bytes = inputs.param_bytes, inputs.reduce_bytes
    shard_bytes = inputs.master_bytes or param_bytes
    dense_unit, moe_unit, n_dense, n_moe, unit = u.dense, u.moe, u.n_dense, u.n_moe, u.unit
    unit_gathered, reduce_input = unit * param_bytes, unit * reduce_bytes
    table, head = table_numel * param_bytes, head_numel * param_bytes
    head_reduce = head_numel * reduce_bytes
    if inputs.reshard_after_forward:
        kept, released = 0, (0, 0)  # gathered from a group's forward to its backward
        below = unit_gathered  # a block prefetched below the running one
    else:  # the embedding and every block gathered until their backward is done
        # a tied table is the head's group, counted with it
        apart = 0 if sp.tied_embeddings else table
        kept = apart + (n_dense * dense_unit + n_moe * moe_unit) * param_bytes
        released = (dense_unit * param_bytes, moe_unit * param_bytes)
        below = 0
    # through the loss the head's group is gathered (its all-gather output released); a
    # stage without the head holds its top block's all-gather output
    forward = loss = kept + (head if head_numel else unit_gathered)
    under_bottom = table if inputs.reshard_after_forward else 0  # the embedding prefetched
    # the top block's backward: the head's reduce-scatter input released (a tied group's
    # gradients are reduced only after the embedding's backward); the block with the one
    # below prefetched, or (seen under full recompute) with its own reduce-scatter input
    top = max(below, reduce_input)  # whichever a trace shows, the larger: the safe side
    layer_transfer = (
        kept + unit_gathered + below + reduce_input,
        kept + unit_gathered + under_bottom + reduce_input,
        kept + unit_gathered + top,
        kept + unit_gathered + under_bottom + (reduce_input if not sp.tied_embeddings else 0),
    )
    accumulating = inputs.accumulating
    live = grads_total if accumulating else 0
    head_sharded = 0 if accumulating else -(-head_numel // inputs.data_parallel) * shard_bytes
    grads_start = live + head_sharded
    head_reduced = (grads_start, kept + 2 * head + head_reduce) if head_numel else None
    done = grads_total if accumulating else u.layers_sharded + head_sharded
    tail_grads, tail_transfer = done, reduce_input if unit else 0
    if table_numel:
        # its post-backward: its gradient and their reduce-scatter input
        tail_grads, tail_transfer = done + table, table_numel * reduce_bytes
        # its backward: the table gathered, its gradient made (:func:`_embedding_grad`), the
        # bottom block's reduce-scatter input
        made = _embedding_grad(inputs, table)
        embedding = (done + made, table + (reduce_input if unit else 0))
        if sum(embedding) > tail_grads + tail_transfer:
            tail_grads, tail_transfer = embedding
    return _Fsdp2Timeline(
        grads_start=grads_start,
        grads_tail=tail_grads,
        transfer_buffers=tail_transfer,
        forward_transfer=forward,
        loss_transfer=loss,
        layer_transfer=layer_transfer,
        released_transfer=released,
        head_reduced=head_reduced,
    )


def _persistent_numel(sp: StageParams, threshold: int) -> int:
    """Elements of the stage's tensors of ``threshold`` elements or fewer (ZeRO-3 keeps them
    whole on every rank: ``stage3_param_persistence_threshold``)."""
    counts = {
        UNIT_EMBED: int(sp.has_embedding),
        UNIT_DENSE: sp.num_layers - sp.num_moe_layers,
        UNIT_MOE: sp.num_moe_layers,
        UNIT_HEAD: int(sp.has_head),
    }
    return sum(
        counts[unit] * sum(n for n, _ in tensors if n <= threshold)
        for unit, tensors in enumerate(sp.unit_tensors)
    )


def deepspeed_states(sp: StageParams, inputs: StatesInputs) -> ModelStates:
    """Persistent state of one stage's rank under DeepSpeed ZeRO (``parallel.zero_stage`` 1-3),
    derived from its source (``deepspeed/runtime/zero/stage_1_and_2.py``:
    ``DeepSpeedZeroOptimizer``; ``stage3.py``: ``DeepSpeedZeroOptimizer_Stage3``;
    ``partitioned_param_coordinator.py``) and held against its own estimators
    (``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``;
    ``tests/planner/test_deepspeed.py``):

    - 16-bit parameters whole on every rank (stage 3: a 1/N partition, tensors up to
      ``stage3_param_persistence_threshold`` elements whole); the fp32 master weights and the
      moments in 1/N partitions;
    - gradients: autograd's 16-bit ones, copied into a reduction bucket of
      ``reduce_bucket_size`` elements (two with ``overlap_comm``; stage 3's kept from the
      start) and reduced into the rank's 16-bit partition (stage 1 keeps every gradient until
      the backward's end, then reduces them into it);
    - the step makes the partition's fp32 gradients (``single_partition_of_fp32_groups``'
      grads) beside the master weights, one flat tensor at a time (a parameter group's
      partition; stage 3 a sub-group of ``sub_group_size`` elements), and the optimizer's
      temporaries are that tensor's;
    - stage 3 gathers up to ``stage3_max_live_parameters`` elements (at least the module
      running) and prefetches ``stage3_prefetch_bucket_size`` more;
    - ``offload.mode: optimizer`` (``offload_optimizer: {device: cpu, ratio}``) moves the
      offloaded share's master weights, moments and fp32 gradients to pinned host RAM, and its
      gradient partition with them.
    """
    dp, ep, stage = inputs.data_parallel, inputs.ep, inputs.zero_stage
    reduce_bucket, reduce_buckets, prefetch, max_live, threshold, sub_group = inputs.deepspeed
    over_dense, over_expert = dp, max(1, dp // ep)
    zero_dense = _zero_shards(dp, stage)
    zero_expert = _zero_shards(over_expert, stage)
    param_bytes, state_bytes = inputs.param_bytes, inputs.state_bytes
    master_bytes = inputs.master_bytes
    dense, expert = sp.dense_numel, sp.expert_numel
    total = dense + expert
    part = _partition(sp, over_dense, over_expert)  # the rank's partition
    offloaded_share = inputs.offload_fraction if inputs.offload_mode == "optimizer" else 0.0
    offloaded = int(part * offloaded_share)
    on_gpu = part - offloaded
    opt_total = _optimizer_bytes(sp, inputs.optimizer, state_bytes, over_dense, over_expert)
    opt = int(opt_total * on_gpu / part) if part else 0
    if stage == 3:
        persistent = _persistent_numel(sp, threshold)
        params = (-(-(dense - persistent) // over_dense) + -(-expert // over_expert)) * param_bytes
        params += persistent * param_bytes
    else:
        params = total * param_bytes
    # gradients after backward: the rank's 16-bit partition (the offloaded share's is on the
    # host); stage 1 holds every gradient until the backward's end reduces them into it
    grads_total = on_gpu * param_bytes
    backward_total = total * param_bytes if stage == 1 else grads_total
    # the optimizer steps one flat fp32 tensor at a time: stages 1 and 2 a parameter group's
    # partition (its fp32 gradients made just before, freed just after; the group of weights
    # is all but the norms and biases: the partition is taken whole), stage 3 a sub-group of
    # at most sub_group_size elements. A step's temporaries are that tensor's, not the model's
    # largest tensor's (a 7B on 8 ranks: "Tried to allocate 3.14 GiB" inside torch's AdamW)
    flat = on_gpu if stage < 3 else min(on_gpu, sub_group)
    opt_temp = flat * 4 + _step_temporaries(sp, inputs, flat, flat, flat)
    ema_total = part * 4 if inputs.ema != "none" else 0
    reduction = min(reduce_bucket, total) * param_bytes * reduce_buckets
    dense_unit = sp.dense_layer_numel
    moe_unit = sp.moe_layer_numel + sp.moe_layer_expert_numel
    unit = max(dense_unit, moe_unit)
    gathered = 0
    if stage == 3:
        gathered = min(total, max(unit, max_live)) * param_bytes
        gathered += min(prefetch, total) * param_bytes
    # the layers' gradients through backward: the partition of each layer above (stage 1:
    # all of them), the running layer's whole in the working precision
    shards = 1 if stage == 1 else dp
    keep = 1.0 if stage == 1 else 1.0 - offloaded_share
    layer_dense = int(-(-dense_unit // shards) * param_bytes * keep)
    layer_moe = int(
        (-(-sp.moe_layer_numel // shards) + -(-sp.moe_layer_expert_numel // max(1, shards // ep)))
        * param_bytes
        * keep
    )
    accumulating = inputs.accumulating
    layer_grads = _running_layer_grads(sp, inputs, layer_dense, layer_moe)
    head = sp.head_unit_numel if sp.has_head else 0
    if sp.tied_embeddings:
        head += sp.embedding_numel
    head_grads = int(-(-head // shards) * param_bytes * keep)
    grads_start = grads_total if accumulating else head_grads
    held = gathered + reduction
    # stage 3's reduction bucket is allocated with the optimizer and kept; stage 1 and 2's
    # exist through backward only
    resident = held if stage == 3 else gathered
    grads_tail = backward_total
    if sp.has_embedding:
        # the embedding's backward makes a table-sized gradient in the working precision
        grads_tail += sp.embedding_numel * param_bytes
    return ModelStates(
        stage_params=sp,
        zero_dense=zero_dense,
        zero_expert=zero_expert,
        offloaded_numel=offloaded,
        gpu_updated_numel=on_gpu,
        params=params,
        grads_total=grads_total,
        grads_start=grads_start,
        layer_grads=layer_grads,
        grads_tail=grads_tail,
        master_params=on_gpu * master_bytes,
        optimizer_states=opt,
        optimizer_temporaries=opt_temp,
        ema=ema_total if inputs.ema == "gpu" else 0,
        transfer_buffers=held,
        forward_transfer=resident,
        loss_transfer=resident,
        layer_transfer=(held,) * 4,
        released_transfer=(0, 0),
        grads_resident=False,
        host=_offloaded_host(inputs, offloaded, opt_total, opt, ema_total),
    )


def megatron_states(sp: StageParams, inputs: StatesInputs) -> ModelStates:
    """Persistent state of one stage's rank under Megatron-Core's data parallelism, derived
    from its source (``megatron/core/distributed/param_and_grad_buffer.py``: the contiguous
    buffers; ``distributed_data_parallel.py``: the buckets, views of them;
    ``megatron/core/optimizer/distrib_optimizer.py``) and held against Megatron-LM's
    theoretical memory report (``megatron/training/theoretical_memory_usage.py``: 18 bytes a
    parameter, or 6 + 12/dp with the distributed optimizer; ``tests/planner/test_megatron.py``):

    - 16-bit parameters whole on every rank (of its tensor and pipeline shard);
    - one contiguous main-gradient buffer of every parameter in ``precision.grads``, allocated
      at start and kept for good: backward's gradient-accumulation fusion adds each weight
      gradient into it, and its buckets (views of it) are reduced, or reduce-scattered in place
      with the distributed optimizer, so no gradient or bucket exists beside it;
    - fp32 master weights and moments, sharded over ``dp x cp`` (experts over their data-parallel
      group) with ``use_distributed_optimizer``, whole without;
    - ``offload.mode: optimizer`` (``optimizer_cpu_offload``, ``optimizer_offload_fraction``):
      Megatron's hybrid device optimizer keeps the offloaded share's master weights and moments
      in host RAM (and copies its gradients there).
    """
    dp, ep = inputs.data_parallel, inputs.ep
    sharded = inputs.distributed_optimizer
    over_dense = dp if sharded else 1
    over_expert = max(1, dp // ep) if sharded else 1
    zero = ZeroShards(1, 1, over_dense)
    zero_expert = ZeroShards(1, 1, over_expert)
    param_bytes, state_bytes, master_bytes = (
        inputs.param_bytes,
        inputs.state_bytes,
        inputs.master_bytes,
    )
    dense, expert = sp.dense_numel, sp.expert_numel
    total = dense + expert
    part = _partition(sp, over_dense, over_expert)
    if inputs.offload_mode == "optimizer":
        off_dense, off_expert = offloaded_numel(
            sp, over_dense, over_expert, inputs.offload_fraction
        )
        offloaded = off_dense + off_expert
    else:
        offloaded = 0
    on_gpu = part - offloaded
    opt_total = _optimizer_bytes(sp, inputs.optimizer, state_bytes, over_dense, over_expert)
    opt = int(opt_total * on_gpu / part) if part else 0
    opt_temp = _step_temporaries(
        sp, inputs, on_gpu, sp.largest_tensor_numel, sp.largest_matrix_numel
    )
    buffer = total * inputs.reduce_bytes  # the main gradients, resident
    ema_total = part * 4 if inputs.ema != "none" else 0
    grads_tail = buffer
    if sp.has_embedding:
        # the embedding's gradient is made by autograd and added into its main gradient
        grads_tail += sp.embedding_numel * param_bytes
    return ModelStates(
        stage_params=sp,
        zero_dense=zero,
        zero_expert=zero_expert,
        offloaded_numel=offloaded,
        gpu_updated_numel=on_gpu,
        params=total * param_bytes,
        grads_total=buffer,
        grads_start=buffer,
        layer_grads=PerKind(dense=_NO_LAYER_GRADS, moe=_NO_LAYER_GRADS),
        grads_tail=grads_tail,
        master_params=on_gpu * master_bytes,
        optimizer_states=opt,
        optimizer_temporaries=opt_temp,
        ema=ema_total if inputs.ema == "gpu" else 0,
        transfer_buffers=0,
        forward_transfer=0,
        loss_transfer=0,
        layer_transfer=(0, 0, 0, 0),
        released_transfer=(0, 0),
        grads_resident=True,
        host=_offloaded_host(inputs, offloaded, opt_total, opt, ema_total),
    )
