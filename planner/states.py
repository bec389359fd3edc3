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
    transfer_buffers: int
    host: HostBytes


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


def model_states(model: ModelSpec, stage: int, inputs: StatesInputs) -> ModelStates:
    """Persistent state of ``stage``'s rank under ``inputs``."""
    sp = stage_params(model, inputs.tp, inputs.pp, inputs.ep, stage)
    streaming = inputs.offload_mode == "streaming"
    param_bytes, grad_bytes, master_bytes = (
        inputs.param_bytes,
        inputs.grad_bytes,
        inputs.master_bytes,
    )
    state_bytes, optimizer, ema = inputs.state_bytes, inputs.optimizer, inputs.ema
    accumulating = inputs.accumulating
    if streaming:  # host holds every persistent byte; ZeRO has nothing to shard on the GPU
        zero_dense = zero_expert = ZeroShards(1, 1, 1)
    else:
        zero_dense = _zero_shards(inputs.data_parallel, inputs.zero_stage)
        zero_expert = _zero_shards(inputs.data_parallel // inputs.ep, inputs.zero_stage)
    dense, expert = sp.dense_numel, sp.expert_numel

    # Model states, local shard, before placement: dense tensors shard over dp x cp, experts
    # over the expert-data-parallel group.
    opt_total = b.optimizer_state_bytes(
        optimizer,
        dense,
        state_bytes,
        matrix_numel=sp.matrix_dense_numel,
        adafactor_numel=sp.adafactor_dense_numel,
        adam8bit_bytes=sp.adam8bit_dense_bytes,
        zero1_shards=zero_dense.optimizer,
    ) + b.optimizer_state_bytes(
        optimizer,
        expert,
        state_bytes,
        matrix_numel=sp.matrix_expert_numel,
        adafactor_numel=sp.adafactor_expert_numel,
        adam8bit_bytes=sp.adam8bit_expert_bytes,
        zero1_shards=zero_expert.optimizer,
    )
    local_opt_numel = -(-dense // zero_dense.optimizer) + -(-expert // zero_expert.optimizer)
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
    ema_total_gpu = ema_total if ema == "gpu" else 0
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
        host=HostBytes(
            params=0,
            grads=offloaded * 4,
            master_params=offloaded * master_bytes,
            optimizer_states=opt_total - opt,
            ema=ema_total if ema == "host" else 0,
            transfer_buffers=0,
        ),
    )
