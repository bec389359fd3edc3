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
"""

from __future__ import annotations

from typing import NamedTuple

from headroom.planner._memo import identity_memo
from headroom.planner.buckets import moe_capacity, moe_dispatch_bytes, routing_slabs
from headroom.planner.coefficients import Coefficients
from headroom.planner.model import ModelSpec


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


@identity_memo(4096, objects=2)
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
) -> LayerActivations:
    """Saved-activation bytes of one dense and one MoE layer (see module docstring)."""
    s_local = -(-seq_len // cp)
    tokens = micro_batch * s_local
    h, e = model.hidden_size, act_bytes
    whole = tp if sequence_parallel else 1  # divisor of hidden-width tensors
    mask = 1 if model.dropout else 0
    heads = model.num_heads
    hidden_tokens = tokens * h // whole

    norms = 2 * hidden_tokens * e
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
        scores = micro_batch * heads * s_local * seq_len * per_score // tp
    ffn_tensors = coeffs.swiglu_saved_ffn_tensors if model.ffn_kind == "swiglu" else 2.0
    mlp_in = hidden_tokens * e + hidden_tokens * mask
    dense_mlp = mlp_in + int(tokens * model.ffn_hidden_size * ffn_tensors) * e // tp

    attention = coeffs.attention_scale * (attn + scores)
    common = coeffs.norm_scale * norms + attention + coeffs.qk_norm_tensors * qk_norms
    mlp_dense = int(coeffs.mlp_scale * dense_mlp)
    dense = int(common) + mlp_dense

    back = coeffs.backward_ffn_tensors
    ffn_tensor = tokens * model.ffn_hidden_size * e // tp  # bytes of one FFN-width tensor
    back_hidden = coeffs.backward_hidden_tensors * hidden_tokens * e
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
        backward_end_moe=end_slots,
        mlp_dense=mlp_dense,
        mlp_moe=mlp_moe,
    )
