"""Activation bytes one layer saves for backward, for one micro-batch on one rank.

The terms generalise Korthikanti et al. 2022 to GQA, MLA, SwiGLU and MoE. For a GPT layer
(MHA, 4h GeLU MLP, LayerNorm, dropout) with 16-bit activations they add up to exactly
``s·b·h·(34 + 5·a·s/h)`` (see ``planner.buckets.korthikanti_layer_bytes``):

    norm inputs 4sbh · attention: QKV input 2, Q 2, K 2, V 2, out-proj input 2, dropout mask 1
    · MLP: input 2, GeLU input 8, GeLU output 8, dropout mask 1 · eager scores: softmax 2as²b,
    dropout mask as²b, dropout output 2as²b.

Grouped keys and values (GQA) are saved at ``kv_heads`` width with 16-bit activations, and
repeated per query head with fp32 ones, which no fused GPU kernel takes grouped. Per-head
query/key norms (Qwen3's ``qk_norm``) save ``qk_norm_tensors`` tensors of
``(heads + kv_heads)·head_dim`` per token (textbook: their input, once). Tensor parallelism
splits the head- and FFN-width tensors; sequence parallelism also the hidden-width ones.
Coefficients scale each group per activation profile.

A stage's terms (``activation_terms``) add the layers up for one micro-batch: what forward
saves, the logits, what each layer's backward holds beyond its saved tensors, and the few
points of the backward where the stage can peak. They depend on the batch shape and recompute,
not on the placement, so ``planner.estimator`` memoises them by ``ActivationInputs``. The
layers' and the head's own terms under one batch shape (``layer_shape``) are memoised for every
recompute at once: a search that varies the recompute works them out once per batch shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import sub
from typing import NamedTuple

from headroom.planner._memo import SMALL_ENTRY_BYTES, BoundedDict
from headroom.planner.buckets import logits_bytes, moe_capacity, moe_dispatch_bytes, routing_slabs
from headroom.planner.coefficients import Coefficients, coefficients_bytes
from headroom.planner.losses import LossShape, loss_bytes
from headroom.planner.model import ModelSpec, spec_bytes
from headroom.planner.stage import PerKind, StageParams, stage_params

_DEFAULT_CAPACITY_FACTOR = 1.25
#: builds a tuple subclass from a tuple of its fields without calling its ``__new__``
_new = tuple.__new__


class LayerActivations(NamedTuple):
    """Per-layer bytes for one micro-batch on one rank."""

    dense: int  # saved by a dense layer with no recompute (attention scores included)
    moe: int  # saved by an MoE layer with no recompute, dispatch buffers excluded
    scores: int  # eager attention probabilities (part of both), dropped by selective recompute
    dispatch: int  # moe_dispatch of one MoE layer
    layer_input: int  # the checkpoint a recomputed layer keeps
    backward_dense: int  # held by a dense layer's backward beyond its saved tensors
    backward_moe: int  # the same for an MoE layer (its larger MLP: routed or shared experts)
    backward_ffn_dense: int  # the part of backward_dense held only during the MLP's backward
    backward_ffn_moe: int  # the same for an MoE layer (its experts' side)
    backward_start_moe: int  # an MoE layer's as its backward starts on the experts' outputs,
    # before any of its gradients exist (held instead of backward_ffn_moe, not beside it)
    backward_end_moe: int  # an MoE layer's as its routed experts' backward ends, beside all of
    # its MLP's gradients (held instead of backward_ffn_moe, not beside it)
    mlp_dense: int  # what a dense layer's MLP saves (part of dense), freed by its backward
    mlp_moe: int  # what an MoE layer's MLP saves (part of moe; its dispatch buffers apart)
    backward_end_dense: int = 0  # a dense layer's as its MLP's backward ends, beside all of
    # its MLP's gradients (DTensor's tensor parallelism: whole-sequence input gradients)


def layer_activations(
    model: ModelSpec,
    coeffs: Coefficients,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    eager: bool,
    tp: int,
    cp: int,
    ep: int,
    sequence_parallel: bool,
    capacity_factor: float,
    imbalance: float,
    gathered_inputs: bool = False,
    ring_attention: bool = False,
    compiled: bool = False,
) -> LayerActivations:
    """Saved-activation bytes of one dense and one MoE layer (see module docstring).

    ``gathered_inputs``: the attention's and the MLP's column-wise projections save their
    input gathered over the sequence (DTensor's tensor parallelism, as torchtitan runs it:
    the all-gather of a sequence-sharded input is the saved tensor), where Megatron's sequence
    parallelism saves the local shard. ``ring_attention``: context parallelism runs torch's
    ring attention (``context_parallel``, as torchtitan runs it), whose backward holds the
    buffers of ``ring_attention_backward``. ``compiled``: the layer runs under torch.compile,
    saving the profile's ``compiled_layer_*_tensors`` fewer hidden- and FFN-width tensors
    (the norms' and the MLP's, where AOTAutograd recomputes elementwise work instead)."""
    s_local = -(-seq_len // cp)
    tokens = micro_batch * s_local
    h, e = model.hidden_size, act_bytes
    whole = tp if sequence_parallel else 1  # divisor of hidden-width tensors
    mask = 1 if model.dropout else 0
    heads = model.num_heads
    hidden_tokens = tokens * h // whole

    # each norm saves its input: two a layer (pre or post), four in Gemma's sandwich, one
    # where attention and the MLP share it (Cohere's parallel block)
    norms = model.norms_per_layer * hidden_tokens * e
    qk_norms = 0  # each head's queries and keys normalised (Qwen3): what the norms save
    if model.qk_norm:
        qk_norms = tokens * (heads + model.kv_heads) * model.dim_per_head * e // tp
    mla = model.mla
    if mla is None:
        d, kv = model.dim_per_head, model.kv_heads
        # fp32 attention repeats grouped keys and values per query head: on a GPU nothing
        # fused takes them grouped at 4 bytes (flash needs 16 bits; memory-efficient has no GQA)
        kv_saved = heads if e >= 4 else kv
        attn = (
            hidden_tokens * e
            + tokens * (2 * heads * d + 2 * kv_saved * d) * e // tp
            + hidden_tokens * mask
            # the rotated queries and keys, where RoPE writes new ones beside the projection's
            # output (Megatron-Core); 0 where a profile's attention_scale holds them
            + int(coeffs.rope_qk_tensors * tokens * (heads + kv) * d) * e // tp
        )
    else:
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q_lora = mla.q_lora_rank or 0
        # the latents' norms are norms: their inputs count with the hidden ones (norm_scale)
        norms += tokens * (q_lora + mla.kv_lora_rank) * e
        attn = (
            hidden_tokens * e
            + tokens * (q_lora + mla.kv_lora_rank + mla.qk_rope_head_dim) * e
            + tokens * heads * (2 * qk + 2 * mla.v_head_dim) * e // tp
            + hidden_tokens * mask
        )
    scores = 0
    if eager:
        per_score = e + (1 + e) * mask  # softmax output, dropout mask, dropout output
        if model.attn_logit_softcap is not None:  # tanh's output, which its backward reads
            per_score += e
        scores = micro_batch * heads * s_local * seq_len * per_score // tp
    swiglu = model.gated_ffn  # SwiGLU and GeGLU save the same tensors
    ffn_tensors = coeffs.swiglu_saved_ffn_tensors if swiglu else coeffs.gelu_saved_ffn_tensors
    # the MLP's input, unless it is the attention's (a parallel block: one tensor, saved once)
    mlp_in = (0 if model.norm_placement == "parallel" else hidden_tokens * e) + hidden_tokens * mask
    dense_mlp = mlp_in + int(tokens * model.ffn_hidden_size * ffn_tensors) * e // tp

    attention = coeffs.attention_scale * (attn + scores)
    common = coeffs.norm_scale * norms + attention + coeffs.qk_norm_tensors * qk_norms
    mlp_dense = int(coeffs.mlp_scale * dense_mlp)
    if compiled and coeffs.compiled_layer_hidden_tensors is not None:
        common -= coeffs.compiled_layer_hidden_tensors * hidden_tokens * e
        ffn_fewer = coeffs.compiled_layer_ffn_tensors or 0.0
        mlp_dense -= int(ffn_fewer * tokens * model.ffn_hidden_size) * e // tp
    # the whole sequence's input of the attention's and the MLP's first projections, beside
    # the local shard the terms above count (a fact of the framework, not scaled)
    gathered = tokens * h * e - hidden_tokens * e if gathered_inputs else 0
    common += gathered
    mlp_dense += gathered
    dense = int(common) + mlp_dense

    back = coeffs.backward_ffn_tensors
    if not swiglu and coeffs.gelu_backward_ffn_tensors is not None:
        back = coeffs.gelu_backward_ffn_tensors
    ffn_tensor = tokens * model.ffn_hidden_size * e // tp  # bytes of one FFN-width tensor
    back_hidden = coeffs.backward_hidden_tensors * hidden_tokens * e
    if sequence_parallel and tp > 1:  # one whole-sequence all-gather buffer (Megatron-Core)
        back_hidden += coeffs.sp_gather_buffer_tensors * tokens * h * e
    moe_bytes = dispatch = back_moe = back_ffn_moe = output_side = end_slots = mlp_moe = 0
    moe = model.moe
    if moe is not None:
        route_tokens = tokens // whole
        group_tokens = route_tokens * ep
        local_experts = -(-moe.num_experts // ep)
        cf = capacity_factor
        capacity = moe_capacity(group_tokens, moe.top_k, moe.num_experts, cf, imbalance)
        dispatch = moe_dispatch_bytes(route_tokens, moe.num_experts, local_experts, capacity, h, e)
        experts = int(local_experts * capacity * moe.expert_ffn_size * ffn_tensors) * e // tp
        shared_width = moe.num_shared_experts * tokens * moe.shared_ffn
        shared = int(shared_width * ffn_tensors) * e // tp
        mlp_moe = int(coeffs.mlp_scale * mlp_in + coeffs.moe_scale * (experts + shared))
        mlp_moe += gathered
        moe_bytes = int(common) + mlp_moe
        # the routed experts' slots: FFN-width gradients of their intermediates (batched over
        # the experts, fitted apart from a dense MLP's where a profile does), and hidden-width
        # ones beside them; the shared experts are a dense MLP
        slots = local_experts * capacity
        routed_tensor = slots * moe.expert_ffn_size * e // tp
        routed_back = coeffs.backward_expert_ffn_tensors
        routed_back = back if routed_back is None else routed_back
        back_ffn_moe = int(max(routed_back * routed_tensor, back * (shared_width * e // tp)))
        back_ffn_moe += int(coeffs.backward_slot_tensors * slots * h * e // whole)
        # as the routed experts' backward ends (their first projections'): the dispatched
        # tokens' hidden-width gradients, beside all of the experts' gradients
        end_slots = int(coeffs.backward_end_slot_tensors * slots * h * e // whole)
        # as the backward starts on the experts' outputs: hidden-width tensors only, and with
        # fp32 routing weights the gradients of the fp32 products (eager autograd: two fp32
        # tensors; Headroom's trainer: slabs of them), before any routed expert's gradient
        # exists (the estimate pairs them with the shared experts' gradients only)
        output_side = int(coeffs.backward_output_slot_tensors * slots * h * e // whole)
        width = h // whole
        elements = slots * width
        limit = coeffs.routing_product_slab_elements
        if limit is not None:  # the routing weights' gradient's product, a slab at a time
            slab_experts, slab_slots = routing_slabs(local_experts, capacity, width, limit)
            elements = slab_experts * slab_slots * width
            output_side += elements * e
        if moe.routing_weights_fp32:
            output_side += int(coeffs.routing_fp32_bytes_per_element * elements)
        back_moe = back_ffn_moe + int(back_hidden)
    # the attention's backward, after the MLP's: under torch's context parallelism its ring
    # buffers, beside all of the MLP's gradients (the larger of the two moments counts)
    ring = 0
    if ring_attention and cp > 1 and not eager:
        head_dim = (
            model.dim_per_head if mla is None else mla.qk_nope_head_dim + mla.qk_rope_head_dim
        )
        ring = ring_attention_backward(tokens * (heads // tp) * head_dim, e, cp)
    end_dense = (
        int(coeffs.tp_backward_end_hidden_tensors * tokens * h * e) if gathered_inputs else 0
    )
    return LayerActivations(
        dense=dense,
        moe=moe_bytes,
        scores=int(coeffs.attention_scale * scores),
        dispatch=dispatch,
        layer_input=hidden_tokens * e,
        backward_dense=int(back * ffn_tensor) + int(back_hidden),
        backward_moe=back_moe,
        backward_ffn_dense=int(back * ffn_tensor),
        backward_ffn_moe=back_ffn_moe,
        backward_start_moe=output_side,
        backward_end_moe=max(end_slots, ring),
        mlp_dense=mlp_dense,
        mlp_moe=mlp_moe,
        # DTensor's tensor parallelism: as the MLP's backward ends, whole-sequence gradients
        # (the output's all-gathered one, the column-wise projections' input gradients as
        # partial sums before their reduce-scatter) beside all of the MLP's gradients
        backward_end_dense=max(end_dense, ring),
    )


def ring_attention_backward(elements: int, act_bytes: int, cp: int) -> int:
    """What torch's ring attention backward (``_templated_ring_attention_backward``, torch
    2.13) holds at its peak beyond its inputs and the three gradients a plain attention's
    backward makes, for ``elements`` in each of the local queries, keys and values (keys and
    values repeated to the queries' heads) of ``act_bytes`` each over ``cp`` ranks: every
    rank's keys and values all-gathered (``2 x act_bytes x cp`` bytes an element), and the
    rest as ``calibration.ring_attention`` traces it at its peak, ``4.5 x act_bytes + 28``:
    the pair concatenated to send, a ring step's three gradients, the fp32 accumulators of
    the three and the fp32 key/value gradients rotated to the next rank, sent and received."""
    return elements * (4 * act_bytes * cp + 9 * act_bytes + 56) // 2


class BlockMatmul(NamedTuple):
    """One matmul of a dense block, as torchtitan's per-op checkpointing policy sees it."""

    in_features: int
    out_features: int  # whole (a column-wise projection's are split over tensor parallelism)
    row_wise: bool  # it projects back to the hidden width (row-wise under tensor parallelism)
    kept: bool  # the policy keeps its output (else the block's backward recomputes it)


def selective_op_matmuls(model: ModelSpec) -> tuple[BlockMatmul, ...]:
    """A dense block's matmuls in torchtitan's Llama order (the fused Q/K/V projection, the
    output projection, then the MLP's w1, w3, w2, or a two-matrix MLP's first and second),
    each marked with whether torchtitan's per-op policy keeps its output
    (``torchtitan/distributed/activation_checkpoint.py``, ``SelectiveAC``): a biased
    projection runs as ``aten.addmm``, in the save list and not counted; the bias-free ones run
    as ``aten.mm``, counted per block from 1 in forward order, and the odd-numbered ones are
    kept. A bias-free Llama block keeps Q/K/V's, w1's and w2's outputs and recomputes the
    output projection's and w3's."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    q_width, kv_width = model.num_heads * model.dim_per_head, model.kv_heads * model.dim_per_head
    mlp_bias = model.mlp_bias or model.linear_bias
    layout = [
        (h, q_width + 2 * kv_width, False, model.qkv_bias or model.linear_bias),
        (q_width, h, True, model.attention_out_bias or model.linear_bias),
    ]
    if model.gated_ffn:
        layout += [(h, ffn, False, mlp_bias), (h, ffn, False, mlp_bias), (ffn, h, True, mlp_bias)]
    else:
        layout += [(h, ffn, False, mlp_bias), (ffn, h, True, mlp_bias)]
    out, counted = [], 0
    for in_features, out_features, row_wise, biased in layout:
        if not biased:
            counted += 1
        out.append(BlockMatmul(in_features, out_features, row_wise, biased or counted % 2 == 1))
    return tuple(out)


def selective_op_layer_bytes(
    model: ModelSpec,
    coeffs: Coefficients,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    eager: bool,
    tp: int,
    cp: int,
    sequence_parallel: bool,
) -> int:
    """What one dense layer keeps for its backward under torchtitan's per-op selective
    checkpointing (``recompute: selective_op``), derived from its policy, for one micro-batch
    on one rank.

    Each block is a checkpointed region whose backward re-runs it. The region keeps its input,
    the outputs of the matmuls the policy keeps (``selective_op_matmuls``; a row-wise
    projection's is the whole local sequence at full width on every tensor-parallel rank, a
    partial sum before its reduction), the outputs of the listed collectives (sequence
    parallelism's ``reduce_scatter_tensor`` after the two row-wise projections), and what the
    attention operator returns: its output and an fp32 log-sum-exp per head and position
    (flash-style kernels), and with ``coeffs.selective_op_saves_attention_inputs`` its queries,
    keys and values too (the forward graph of torchtitan's compiled FlexAttention returns them
    for its backward); eager attention keeps its two batched matmuls' outputs (the scores before
    softmax, and the output). Norms, RoPE, activation functions, dropout, residual adds and
    copies are recomputed."""
    column, rows, q_width, qkv_width = _selective_op_widths(model)
    s_local = -(-seq_len // cp)
    h, heads = model.hidden_size, model.num_heads
    token_bytes = micro_batch * s_local * act_bytes
    whole = tp if sequence_parallel else 1  # divisor of hidden-width tensors
    # the region's input, the kept column-wise outputs (split) and row-wise ones (whole)
    saved = token_bytes * h // whole + token_bytes * column // tp + rows * token_bytes * h
    if sequence_parallel and tp > 1:  # the row-wise projections' reduce-scatter outputs
        saved += 2 * (token_bytes * h // tp)
    if eager:
        saved += micro_batch * heads * s_local * seq_len * act_bytes // tp
        saved += token_bytes * q_width // tp
    else:
        saved += token_bytes * q_width // tp + micro_batch * s_local * heads * 4 // tp
        if coeffs.selective_op_saves_attention_inputs:
            saved += token_bytes * qkv_width // tp
    return saved


def _selective_op_widths(model: ModelSpec) -> tuple[int, int, int, int]:
    """(the widths of the column-wise outputs the per-op policy keeps, how many row-wise
    outputs it keeps, the queries' width, Q/K/V's width) of ``model``'s dense block: what
    ``selective_op_matmuls`` says, in plain arithmetic (a search asks for it per batch
    shape)."""
    d = model.dim_per_head
    q_width = model.num_heads * d
    qkv_width = q_width + 2 * model.kv_heads * d
    linear, ffn = model.linear_bias, model.ffn_hidden_size
    mlp_bias = model.mlp_bias or linear
    # (output width, row-wise, biased) in forward order
    layout = [
        (qkv_width, False, model.qkv_bias or linear),
        (0, True, model.attention_out_bias or linear),
    ]
    if model.gated_ffn:
        layout += [(ffn, False, mlp_bias), (ffn, False, mlp_bias), (0, True, mlp_bias)]
    else:
        layout += [(ffn, False, mlp_bias), (0, True, mlp_bias)]
    column = rows = counted = 0
    for width, row_wise, biased in layout:
        counted += not biased
        if biased or counted % 2:
            if row_wise:
                rows += 1
            else:
                column += width
    return column, rows, q_width, qkv_width


class ActivationInputs(NamedTuple):
    """Everything ``activation_terms`` reads besides the model, coefficients and stage (also
    its cache key)."""

    tp: int
    pp: int
    ep: int
    cp: int
    sequence_parallel: bool
    micro_batch: int
    seq_len: int
    act_bytes: int  # bytes per activation element (the working precision)
    eager_attention: bool
    capacity_factor: float | None  # None: the model's own, else 1.25
    imbalance: float
    gathered_tp_inputs: bool  # column-wise projections save their sequence-gathered input
    # (DTensor's tensor parallelism under FSDP2; loss parallelism's fp32 tensor beside it)
    edges: bool  # the stage's bottom and top layers are points of their own (FSDP2: no
    # prefetch under the bottom layer, no reduce-scatter above the top one)
    loss_impl: str  # the loss's implementation: standard (the profile's) or a derived one
    # (``planner.losses``)
    loss_chunks: int  # chunks it splits the tokens into (0: none by count)
    ring_attention: bool  # context parallelism through torch's ring attention (FSDP2's stacks)
    compiled_layers: bool  # the decoder layers run under torch.compile (TrainSpec.compile)
    # recompute last: the fields before them are ``layer_shape``'s key
    selective: bool  # selective recompute: each layer re-runs its attention scores
    selective_op: bool  # torchtitan's per-op selective checkpointing: every layer a block
    # whose backward re-runs it, what its policy saves kept (``selective_op_layer_bytes``)
    checkpoint_every: int | None  # layers per recomputed block (None: no block recompute)
    v_shaped: bool  # a V schedule's placement: the first rank holds the head


#: ``ActivationInputs``' fields before the recompute ones (``layer_shape``'s key)
_SHAPE_FIELDS = ActivationInputs._fields.index("selective")


#: a backward point's ``edge``: a layer between others, the stage's bottom, its top, both
MIDDLE, BOTTOM, TOP, ONLY = 0, 1, 2, 3


class LayerTemporaries(NamedTuple):
    """What one layer's backward holds beyond its saved tensors, by moment (bytes)."""

    throughout: int  # held throughout its backward
    mlp: int  # held during its MLP's backward only
    mlp_saved: int  # its MLP's saved tensors, freed once the MLP's backward is done
    start: int  # held as it starts (an MoE layer's, on its experts' outputs, before any
    # routed expert's gradient; 0: no such point)
    end: int  # held as its MLP's backward ends (an MoE layer's routed experts' input
    # gradients)
    dispatch: int = 0  # its dispatch buffers, freed with its MLP's saved tensors


class BackwardPoint(NamedTuple):
    """One micro-batch at the peak of one layer's backward."""

    dense_layers: int  # dense layers whose gradients exist (those above the running one)
    moe_layers: int  # MoE layers whose gradients exist
    activations: int  # the micro-batch's saved activations then
    dispatch: int  # its dispatch buffers then
    is_moe: int  # the running layer's kind: 1 MoE, 0 dense (an index into a ``PerKind``)
    edge: int  # ``MIDDLE``, ``BOTTOM``, ``TOP`` or ``ONLY`` (always ``MIDDLE`` unless the
    # stage's edges were asked apart)


class PointLayout(NamedTuple):
    """A backward point as counts of layers, independent of their sizes."""

    dense_layers: int  # dense layers with gradients
    moe_layers: int  # MoE layers with gradients
    checkpoints: int  # checkpoints held (the blocks below the running one's)
    held_dense: int  # dense layers of the recomputed (or saved) block up to the running one
    held_moe: int  # MoE layers of it
    is_moe: int  # the running layer's kind
    edge: int  # as ``BackwardPoint.edge``


class ActivationTerms(NamedTuple):
    """Activations, dispatch buffers and logits of one stage's rank for one micro-batch."""

    layer: LayerActivations  # one dense and one MoE layer's terms
    activations_saved: int  # at the end of forward
    dispatch_saved: int  # at the end of forward
    backward_points: tuple[BackwardPoint, ...]  # where its backward through the layers can peak
    temporaries: PerKind[LayerTemporaries]  # a dense and an MoE layer's backward's
    logits_forward: int
    logits_backward: int


class LayerTerms(NamedTuple):
    """What every layer of a kind holds under one set of inputs, whichever stage it is in."""

    layer: LayerActivations  # one dense and one MoE layer's terms
    saved_dense: int  # what a dense layer keeps for its backward (its scores not, with
    # selective recompute)
    saved_moe: int  # the same for an MoE layer, its dispatch buffers apart
    temporaries: PerKind[LayerTemporaries]  # a dense and an MoE layer's backward's


#: (saved by a dense layer, saved by an MoE layer, held throughout a dense layer's backward,
#: the same for an MoE layer, what a layer below the running one keeps: its checkpoint) under
#: one kind of recompute; the first four are the running layer's (with block recompute, the
#: re-run layer's)
Recomputed = tuple[int, int, int, int, int]


class LayerShape(NamedTuple):
    """The layers' own terms under one batch shape, for each kind of recompute (what
    ``layer_terms`` reads besides the recompute), and the head's."""

    layer: LayerActivations  # one dense and one MoE layer's terms
    head: tuple[int, int, int]  # ``head_terms``
    plain: Recomputed  # without recompute
    selective: Recomputed  # each layer re-runs its attention scores in its own backward
    blocks: Recomputed  # blocks of layers re-run from their checkpoints
    selective_op: Recomputed  # torchtitan's per-op policy: each layer re-run in its backward
    # from what the policy kept


#: ``layer_shape``'s memo: (model, coefficients) by identity and the inputs besides the
#: recompute -> (the model and coefficients, kept alive so their ids stay unique; the shape).
#: A search's candidates that differ only in their recompute share an entry.
_SHAPES: BoundedDict[
    tuple[int, int, tuple[object, ...]], tuple[ModelSpec, Coefficients, LayerShape]
] = BoundedDict(4096, 4 << 20)


def layer_shape(model: ModelSpec, coeffs: Coefficients, inputs: ActivationInputs) -> LayerShape:
    """The layers' and the head's terms under ``inputs``' batch shape (memoised; its recompute
    is not read)."""
    key = (id(model), id(coeffs), inputs[:_SHAPE_FIELDS])
    hit = _SHAPES.get(key)
    if hit is not None:
        return hit[2]
    moe = model.moe
    capacity_factor = (
        inputs.capacity_factor or (moe.capacity_factor if moe else None) or _DEFAULT_CAPACITY_FACTOR
    )
    tp = inputs.tp
    layer = layer_activations(
        model,
        coeffs,
        inputs.micro_batch,
        inputs.seq_len,
        inputs.act_bytes,
        inputs.eager_attention,
        tp,
        inputs.cp,
        inputs.ep,
        inputs.sequence_parallel,
        capacity_factor,
        inputs.imbalance,
        inputs.gathered_tp_inputs and tp > 1,
        inputs.ring_attention,
        inputs.compiled_layers,
    )
    saved_dense, saved_moe, scores, layer_input = (
        layer.dense,
        layer.moe,
        layer.scores,
        layer.layer_input,
    )
    # held throughout the layer's backward; the FFN-width part during its MLP's only
    throughout_dense = layer.backward_dense - layer.backward_ffn_dense
    throughout_moe = layer.backward_moe - layer.backward_ffn_moe
    rerun = int(coeffs.recompute_hidden_tensors * layer_input)
    op_saved = selective_op_layer_bytes(
        model,
        coeffs,
        inputs.micro_batch,
        inputs.seq_len,
        inputs.act_bytes,
        inputs.eager_attention,
        tp,
        inputs.cp,
        inputs.sequence_parallel,
    )
    # built by position (fields in declaration order) with ``tuple.__new__``: a search builds
    # one for every new batch shape
    shape = _new(
        LayerShape,
        (
            layer,
            head_terms(model, coeffs, inputs),
            (saved_dense, saved_moe, throughout_dense, throughout_moe, layer_input),  # plain
            # selective: each layer recomputes its scores in its own backward
            (
                saved_dense - scores,
                saved_moe - scores,
                throughout_dense + scores,
                throughout_moe + scores,
                layer_input,
            ),
            # blocks
            (saved_dense, saved_moe, throughout_dense + rerun, throughout_moe + rerun, layer_input),
            # selective_op: the layers below keep what the policy saved; the running one is
            # re-run in its backward, as a block of one (dense layers only: ``check_selective_op``)
            (saved_dense, saved_moe, throughout_dense + rerun, throughout_moe + rerun, op_saved),
        ),
    )
    weight = spec_bytes(model) + coefficients_bytes(coeffs) + SMALL_ENTRY_BYTES
    return _SHAPES.put(key, (model, coeffs, shape), weight)[2]


def clear_layer_shapes() -> None:
    """Forget every memoised ``layer_shape``."""
    _SHAPES.clear()


def recomputed(shape: LayerShape, inputs: ActivationInputs) -> Recomputed:
    """``shape``'s terms under ``inputs``' recompute."""
    if inputs.checkpoint_every is not None:
        return shape.blocks
    if inputs.selective_op:
        return shape.selective_op
    return shape.selective if inputs.selective else shape.plain


def block_layers(inputs: ActivationInputs) -> int | None:
    """Layers per block re-run in backward under ``inputs``' recompute (None: none re-run):
    ``checkpoint_every``, or under torchtitan's per-op policy every layer (each block is its
    own checkpointed region)."""
    return 1 if inputs.selective_op else inputs.checkpoint_every


def layer_terms(model: ModelSpec, coeffs: Coefficients, inputs: ActivationInputs) -> LayerTerms:
    """The layers' own terms under ``inputs``: the part of ``activation_terms`` no stage
    changes."""
    shape = layer_shape(model, coeffs, inputs)
    layer = shape.layer
    saved_dense, saved_moe, throughout_dense, throughout_moe, _ = recomputed(shape, inputs)
    # built by position (fields in declaration order) with ``tuple.__new__``: a search builds
    # these for every new batch shape, and a named tuple's own ``__new__`` is a Python call
    dense_temporaries = (
        throughout_dense,
        layer.backward_ffn_dense,
        layer.mlp_dense,
        0,
        layer.backward_end_dense,
        0,
    )
    moe_temporaries = (
        throughout_moe,
        layer.backward_ffn_moe,
        layer.mlp_moe,
        layer.backward_start_moe,
        layer.backward_end_moe,
        layer.dispatch,
    )
    temporaries = _new(
        PerKind,
        (_new(LayerTemporaries, dense_temporaries), _new(LayerTemporaries, moe_temporaries)),
    )
    return _new(LayerTerms, (layer, saved_dense, saved_moe, temporaries))


def stage_activation_terms(
    model: ModelSpec,
    coeffs: Coefficients,
    sp: StageParams,
    inputs: ActivationInputs,
    terms: LayerTerms,
    points: tuple[BackwardPoint, ...] | None = None,
) -> ActivationTerms:
    """One micro-batch's activation terms of the rank of the stage ``sp`` under ``inputs``,
    from its layers' ``terms`` (and its ``backward_points``, if given: those of a stage whose
    layers are of the same kinds in the same order)."""
    layer, saved_dense, saved_moe, temporaries = terms
    k, dispatch = block_layers(inputs), layer.dispatch
    checkpoint = recomputed(layer_shape(model, coeffs, inputs), inputs)[4]
    n, n_moe = sp.num_layers, sp.num_moe_layers
    if k is None:
        saved = (n - n_moe) * saved_dense + n_moe * saved_moe
        dispatch_saved = n_moe * dispatch
    else:
        saved = -(-n // k) * checkpoint
        dispatch_saved = 0
    if points is None:
        points = backward_points(
            sp.moe_flags, k, saved_dense, saved_moe, dispatch, checkpoint, inputs.edges
        )
    logits_forward = logits_backward = 0
    if sp.has_head:
        head_saved, logits_forward, logits_backward = layer_shape(model, coeffs, inputs).head
        saved += head_saved
    return _new(
        ActivationTerms,
        (layer, saved, dispatch_saved, points, temporaries, logits_forward, logits_backward),
    )


def head_terms(
    model: ModelSpec, coeffs: Coefficients, inputs: ActivationInputs
) -> tuple[int, int, int]:
    """What the stage holding the head adds for one micro-batch: (saved for the head's
    backward, logits through forward, the loss's backward beside them). The loss's two terms
    are the profile's coefficients under the standard loss, else derived from the loss's
    implementation (``planner.losses``: what it holds from its forward into its backward, and
    its largest moment beyond that, priced at the loss's point)."""
    act_bytes, tp = inputs.act_bytes, inputs.tp
    seq_local = -(-inputs.seq_len // inputs.cp)
    tokens = inputs.micro_batch * seq_local
    vocab_local = -(-model.vocab_size // tp)
    standard = inputs.loss_impl == "standard"
    if standard:
        logits_forward = logits_bytes(tokens, vocab_local, coeffs.logits_bytes_per_element)
        backward_bpe = coeffs.logits_backward_bytes_per_element
        logits_backward = logits_bytes(tokens, vocab_local, backward_bpe)
    else:
        shape = LossShape(inputs.micro_batch, seq_local, model.hidden_size, vocab_local, act_bytes)
        logits_forward, logits_backward = loss_bytes(inputs.loss_impl, inputs.loss_chunks, shape)
    saved = 0
    if standard and model.final_logit_softcap is not None:
        # the capped logits: tanh's output (in the logits' dtype), kept for its backward
        saved += tokens * vocab_local * act_bytes
    if coeffs.head_hidden_tensors:
        whole = tp if inputs.sequence_parallel else 1
        head = int(coeffs.head_hidden_tensors * tokens * model.hidden_size * act_bytes)
        saved += head // whole
    if inputs.gathered_tp_inputs and tp > 1:
        # DTensor's column-wise head saves its input gathered over the sequence, beside the
        # shard counted above; loss parallelism's backward holds an fp32 tensor per local
        # logit beside the others
        hidden = tokens * model.hidden_size * act_bytes
        saved += hidden - hidden // tp
        if standard:  # DTensor's loss parallelism (Megatron's fused loss is its own)
            logits_backward += logits_bytes(tokens, vocab_local, 4)
    return saved, logits_forward, logits_backward


def stages_activation_terms(
    model: ModelSpec,
    coeffs: Coefficients,
    stages: Sequence[StageParams],
    inputs: ActivationInputs,
) -> tuple[ActivationTerms, ...]:
    """``activation_terms`` of each of ``stages`` (their ``stage_params``): the layers' own
    terms once for all of them, and the backward points once for stages whose layers are of
    the same kinds in the same order (a pipeline's end stages, mostly)."""
    terms = layer_terms(model, coeffs, inputs)
    first = stage_activation_terms(model, coeffs, stages[0], inputs, terms)
    if len(stages) == 1:
        return (first,)
    out = [first]
    for i in range(1, len(stages)):
        sp, points = stages[i], None
        if sp.moe_flags == stages[i - 1].moe_flags:
            points = out[-1].backward_points
        out.append(stage_activation_terms(model, coeffs, sp, inputs, terms, points))
    return tuple(out)


def activation_terms(
    model: ModelSpec, coeffs: Coefficients, stage: int, inputs: ActivationInputs
) -> ActivationTerms:
    """One micro-batch's activation terms of ``stage``'s rank under ``inputs``."""
    sp = stage_params(model, inputs.tp, inputs.pp, inputs.ep, stage, inputs.v_shaped)
    return stage_activation_terms(model, coeffs, sp, inputs, layer_terms(model, coeffs, inputs))


#: an upper bound of the bytes one backward point holds (a named tuple of five numbers)
POINT_BYTES = 256
#: point sets this long or longer are ``ManyPoints``
MANY_POINTS = 32
#: pairs of layer gradients whose best points one ``ManyPoints`` remembers
_REMEMBERED = 64


class ManyPoints(tuple[BackwardPoint, ...]):
    """A stage's backward points when there are many (layers of irregular kinds): the tuple,
    which also remembers each kind's best point per pair of layer gradients
    (``planner.phases``), so a search walks them once per pair rather than once per candidate.
    What it remembers lives and dies with the points."""

    best: dict[tuple[int, int], tuple[BackwardPoint, ...]]

    def __new__(cls, points: Sequence[BackwardPoint]) -> ManyPoints:
        self = super().__new__(cls, points)
        self.best = {}
        return self

    def remember(self, key: tuple[int, int], best: tuple[BackwardPoint, ...]) -> None:
        """Keep ``best`` for ``key`` (up to a few dozen pairs: the rest are walked again)."""
        if len(self.best) < _REMEMBERED:
            self.best[key] = best


def terms_bytes(terms: ActivationTerms) -> int:
    """An upper bound of the bytes ``terms`` holds: a cache entry's weight (``planner._memo``)."""
    points = terms.backward_points
    remembered = _REMEMBERED * 512 if isinstance(points, ManyPoints) else 0
    return 4096 + POINT_BYTES * len(points) + remembered


def backward_points(
    flags: Sequence[int],
    k: int | None,
    saved_dense: int,
    saved_moe: int,
    dispatch: int,
    layer_input: int,
    edges: bool = False,
) -> tuple[BackwardPoint, ...]:
    """Where one micro-batch's backward through the stage's layers can peak.

    At layer j's backward the gradients of the layers above j exist and j's own are being
    made; the micro-batch holds the saved tensors of the layers up to j (without recompute)
    or the checkpoints of the blocks below j's and the recomputed block up to j (j's own
    backward temporaries and gradients being made are the caller's, by kind). Which layers
    they are depends on the layout only (``point_layout``); ``saved_*`` are what a dense and
    an MoE layer save, ``dispatch`` an MoE layer's dispatch buffers, ``layer_input`` a
    checkpoint. With ``edges`` the stage's bottom and top layers (and the layers next to
    them) are points of their own, marked in ``edge``.
    """
    # unpacked, and built by position with ``tuple.__new__`` in a plain loop: a search builds
    # these for every new batch shape
    points = []
    for dense, moe, checkpoints, held_dense, held_moe, is_moe, edge in point_layout(
        flags, k, edges
    ):
        activations = checkpoints * layer_input + held_dense * saved_dense + held_moe * saved_moe
        points.append(
            _new(BackwardPoint, (dense, moe, activations, held_moe * dispatch, is_moe, edge))
        )
    return ManyPoints(points) if len(points) >= MANY_POINTS else tuple(points)


#: ``point_layout``'s memo: (layer kinds, block size) -> the layouts
_LAYOUTS: BoundedDict[tuple[Sequence[int], int | None, bool], tuple[PointLayout, ...]] = (
    BoundedDict(1024, 8 << 20)
)


def point_layout(
    flags: Sequence[int], k: int | None, edges: bool = False
) -> tuple[PointLayout, ...]:
    """The layers ``backward_points`` evaluates, as counts (memoised; ``flags``: 1 or True for
    each MoE layer of the stage, bytes or a tuple). Between two layers of one kind in one block
    the bytes change linearly, and so do they between consecutive blocks of the same shape, so
    the ends of such runs are the only candidates (a stage of one kind of layer has two to
    six). With ``edges`` the bottom and top layers differ from the rest by more than their
    counts (``PointLayout.edge``), so the layers next to them and every layer of the blocks
    next to theirs are candidates too, and an edge layer never ends a run."""
    key = (flags, k, edges)
    hit = _LAYOUTS.get(key)
    if hit is None:
        layouts = _point_layout(flags, k, edges)
        hit = _LAYOUTS.put(key, layouts, 8 * len(flags) + POINT_BYTES * len(layouts) + 512)
    return hit


def _edge(j: int, n: int, edges: bool) -> int:
    """``PointLayout.edge`` of layer ``j`` of ``n``."""
    if not edges:
        return MIDDLE
    return (BOTTOM if j == 0 else MIDDLE) | (TOP if j == n - 1 else MIDDLE)


def _point_layout(flags: Sequence[int], k: int | None, edges: bool) -> tuple[PointLayout, ...]:
    n = len(flags)
    if not n:
        return ()
    size = n if k is None else k
    # beside the bottom and the top layer, with edges, the layers next to them
    near_edges = {j for j in (1, n - 2) if 0 < j < n - 1} if edges else set()
    if all(flags) or not any(flags):  # one kind: the bottom, last full and partial top blocks
        is_moe = int(flags[0])
        size = min(size, n)
        full = n // size
        starts = {0, (full - 1) * size, full * size}
        if edges:  # the blocks next to an edge layer's: runs of blocks are linear between them
            starts |= {size, (full - 2) * size}
        tops = {
            b0 + layers - 1 for b0 in starts if 0 <= b0 < n for layers in {1, min(size, n - b0)}
        }
        uniform = []
        for j in sorted(tops | near_edges):
            b0 = j // size * size
            checkpoints = 0 if k is None else b0 // size
            layers, above, edge = j - b0 + 1, n - 1 - j, _edge(j, n, edges)
            if is_moe:
                uniform.append(PointLayout(0, above, checkpoints, 0, layers, 1, edge))
            else:
                uniform.append(PointLayout(above, 0, checkpoints, layers, 0, 0, edge))
        return tuple(uniform)
    # blocks from the first layer: [b0, b0 + size); runs of identical blocks keep their ends
    blocks = [(b0, flags[b0 : b0 + size]) for b0 in range(0, n, size)]
    # with edges, the blocks holding an edge layer and the blocks next to them: an edge layer
    # holds what a framework holds there, so a run of blocks does not stay linear through it
    edge_blocks = {b + d for b in (0, len(blocks) - 1) for d in (-1, 0, 1)} if edges else set()
    chosen = [
        i
        for i, (_, shape) in enumerate(blocks)
        if i in (0, len(blocks) - 1)
        or shape != blocks[i - 1][1]
        or shape != blocks[i + 1][1]
        or i in edge_blocks
    ]
    dense_above = [0] * (n + 1)  # dense_above[j]: dense layers at j or above
    for j in range(n - 1, -1, -1):
        dense_above[j] = dense_above[j + 1] + (not flags[j])
    # (point, its class within its block, its class across blocks); blocks of the same
    # layers share a shape number (a block's layers are hashed once, not once per point)
    shapes: dict[Sequence[int], int] = {}
    found: list[tuple[PointLayout, tuple[int, ...], tuple[int, ...]]] = []
    for i in chosen:
        b0, shape = blocks[i]
        shape_number = shapes.setdefault(shape, len(shapes))
        checkpoints = 0 if k is None else b0 // size
        held = [0, 0]
        for offset, kind in enumerate(shape):
            j = b0 + offset
            held[kind] += 1
            last = offset == len(shape) - 1 or shape[offset + 1] != kind
            first = offset == 0 or shape[offset - 1] != kind
            if first or last or j in near_edges:
                dense = dense_above[j + 1]
                moe = n - j - 1 - dense
                edge = _edge(j, n, edges)
                point = PointLayout(dense, moe, checkpoints, held[0], held[1], int(kind), edge)
                # an edge layer's point is a class of its own, never the far end of a run
                found.append((point, (i, kind, edge), (kind, offset, shape_number, edge)))
    return _without_midpoints(found)


#: strides at which ``_without_midpoints`` looks for a point's neighbours in its class
_STRIDES = (1, 2, 3, 4)


def _without_midpoints(
    found: list[tuple[PointLayout, tuple[int, ...], tuple[int, ...]]],
) -> tuple[PointLayout, ...]:
    """The points of ``found`` without those halfway between an earlier and a later point of
    one of their classes (each entry's other two items: its kind and block, and its kind, place
    in its block and the block's layers), at a few strides through the class.

    A backward point's bytes are linear in its counts, and the running layer's own terms are
    the same for every point of its kind, so such a point's total is the mean of the two: never
    larger than both, and when it equals the largest the earlier one does too and comes first,
    which wins the tie. So the first largest point always stays (whatever else goes at the same
    time), and periodic layers (an MoE layer every third, blocks that repeat with a period)
    keep a few points per class, however many layers they span."""
    members: dict[tuple[int, ...], list[int]] = {}
    for index, (_, within, across) in enumerate(found):
        members.setdefault(within, []).append(index)
        members.setdefault(across, []).append(index)
    dropped: set[int] = set()
    for indices in members.values():
        points = [found[i][0] for i in indices]
        for stride in _STRIDES:
            if len(points) <= 2 * stride:
                break
            # steps[m]: from the class's point m to point m + stride
            pairs = zip(points[:-stride], points[stride:], strict=True)
            steps = [tuple(map(sub, b, a)) for a, b in pairs]
            dropped.update(
                indices[m + stride]
                for m, (step, next_step) in enumerate(
                    zip(steps[:-stride], steps[stride:], strict=True)
                )
                if step == next_step
            )
    return tuple(entry[0] for index, entry in enumerate(found) if index not in dropped)
