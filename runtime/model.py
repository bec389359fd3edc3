"""The built-in decoder family, built from the planner's ``ModelSpec``.

RMSNorm (or LayerNorm), RoPE, GQA attention through ``scaled_dot_product_attention`` (grouped
keys and values taken as they are in 16 bits, repeated per query head in fp32) or DeepSeek's
multi-head latent attention (values narrower than queries and keys), Qwen3's
per-head query/key norms when the spec has them, SwiGLU (or GeLU) MLPs, optional MoE layers
(top-k softmax router, capacity factor, shared experts, shared expert gate, dense-first
layers, DeepSeek's routing bias and fp32 routing weights), tied embeddings. Parameter names
and shapes follow the planner's inventory (``planner.params.units``), so the parameter count is
the planner's and the optimizer-offload split by whole tensors in order is the one the planner
predicts. Routed experts are stacked: one ``(E, out, in)`` tensor per projection, as the planner
counts them.

Each layer is a self-contained module ``layer(h, cos, sin) -> h`` so the streaming trainer can
run any layer's weights through one template with ``torch.func.functional_call``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from headroom.planner.buckets import ROUTING_SLAB_ELEMENTS, routing_slabs
from headroom.planner.model import ModelSpec
from headroom.runtime.support import check_supported

ROPE_THETA = 10_000.0
NORM_EPS = 1e-5
INIT_STD = 0.02


class Norm(nn.Module):
    """The spec's norm over ``width``, learning what ``spec.norm_params`` says."""

    def __init__(self, width: int, spec: ModelSpec) -> None:
        super().__init__()
        self.kind = spec.norm
        weight, bias = spec.norm_weights
        self.weight = nn.Parameter(torch.ones(width)) if weight else None
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, NORM_EPS)
        # one fp32 copy of the input serves both the variance and the scaling (autograd keeps
        # it once; two casts would keep two)
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        out = (xf * torch.rsqrt(variance + NORM_EPS)).to(x.dtype)
        out = out if self.weight is None else out * self.weight
        return out if self.bias is None else out + self.bias


def _linear(inp: int, out: int, bias: bool) -> nn.Linear:
    return nn.Linear(inp, out, bias=bias)


def _flash_only(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On a GPU, grouped attention must run the flash kernel: SDPA would otherwise fall back,
    silently, to its math kernel, which materialises every score."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


@functools.cache
def grouped_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention takes the grouped keys and values as they are (``enable_gqa``), saving
    them at ``kv_heads`` width instead of repeated per query head.

    Only 16-bit attention does, on every device alike, so that the trainer's memory on a CPU
    trace is its memory on a GPU: there the flash kernel takes grouped keys and values in 16
    bits, and nothing fused does in fp32 (the memory-efficient kernel has no GQA). On a GPU the
    flash kernel is tried once per (device, dtype, head_dim) with a tiny forward and backward.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if device.type == "cpu":  # the CPU flash kernel takes grouped keys and values
        return True
    if device.type != "cuda":
        return False
    try:
        with torch.enable_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            q = torch.zeros(1, 2, 8, head_dim, dtype=dtype, device=device, requires_grad=True)
            kv = torch.zeros(1, 1, 8, head_dim, dtype=dtype, device=device, requires_grad=True)
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            out.sum().backward()
    except RuntimeError:
        return False
    return True


def kv_layout(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str:
    """How attention keeps its keys and values: ``multi-head`` (as many as query heads),
    ``grouped`` (GQA, at kv width) or ``repeated`` (GQA, repeated per query head)."""
    if spec.kv_heads == spec.num_heads:
        return "multi-head"
    return "grouped" if grouped_attention(device, dtype, spec.dim_per_head) else "repeated"


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.dim_per_head
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.kv_heads, d
        qkv_bias = spec.qkv_bias or spec.linear_bias
        self.q_proj = _linear(h, self.heads * d, qkv_bias)
        self.k_proj = _linear(h, self.kv_heads * d, qkv_bias)
        self.v_proj = _linear(h, self.kv_heads * d, qkv_bias)
        self.o_proj = _linear(self.heads * d, h, spec.linear_bias or spec.attention_out_bias)
        # Qwen3: each head's queries and keys normalised over head_dim, before RoPE
        self.q_norm = Norm(d, spec) if spec.qk_norm else None
        self.k_norm = Norm(d, spec) if spec.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads == self.heads:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif grouped_attention(q.device, q.dtype, self.head_dim):
            with _flash_only(q.device):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            repeat = self.heads // self.kv_heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention: queries through an optional low-rank
    projection, keys and values from one compressed latent, RoPE on a separate slice of the
    queries and on one key shared by every head; values narrower than queries and keys."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None
        h, heads, bias = spec.hidden_size, spec.num_heads, spec.linear_bias
        self.heads, self.kv_rank = heads, mla.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        qk = self.nope + self.rope_dim
        if mla.q_lora_rank is None:
            self.q_proj = _linear(h, heads * qk, bias)
        else:
            self.q_a_proj = _linear(h, mla.q_lora_rank, bias)
            self.q_a_layernorm = Norm(mla.q_lora_rank, spec)
            self.q_b_proj = _linear(mla.q_lora_rank, heads * qk, bias)
        self.kv_a_proj_with_mqa = _linear(h, self.kv_rank + self.rope_dim, bias)
        self.kv_a_layernorm = Norm(self.kv_rank, spec)
        self.kv_b_proj = _linear(self.kv_rank, heads * (self.nope + self.v_dim), bias)
        self.o_proj = _linear(heads * self.v_dim, h, bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        heads = self.heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, heads, self.nope + self.rope_dim).transpose(1, 2)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed))
        k_nope, value = kv.view(b, s, heads, -1).transpose(1, 2).split([self.nope, self.v_dim], -1)
        if self.rope_dim:
            q_nope, q_rope = q.split([self.nope, self.rope_dim], -1)
            k_rope = apply_rope(k_rope.view(b, 1, s, self.rope_dim), cos, sin)
            q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
            key = torch.cat([k_nope, k_rope.expand(b, heads, s, self.rope_dim)], -1)
        else:
            key = k_nope
        # the attention saves its value for backward: as a view it would keep the whole
        # (heads x (nope + v)) up-projection alive; a copy keeps (heads x v) and lets the
        # keys' half go once they are concatenated (DeepSeek-V3: 32 KiB a token a layer)
        value = value.contiguous()
        # values narrower than queries: a GPU runs the memory-efficient kernel here
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * self.v_dim))


def rope_dim(spec: ModelSpec) -> int:
    """The width RoPE rotates: each head's (MLA: the queries' and keys' RoPE slice)."""
    return spec.mla.qk_rope_head_dim if spec.mla is not None else spec.dim_per_head


def gate_activation(spec: ModelSpec) -> Callable[[Tensor], Tensor]:
    """The activation on a gated MLP's gate: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU,
    as Gemma's ``gelu_pytorch_tanh``)."""
    if spec.ffn_kind == "geglu":
        return functools.partial(F.gelu, approximate="tanh")
    return F.silu


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, ffn: int, *, bias: bool | None = None) -> None:
        super().__init__()
        h = spec.hidden_size
        # Llama's mlp_bias biases the dense MLP; shared experts take only linear_bias
        bias = spec.linear_bias or spec.mlp_bias if bias is None else bias
        self.gated = spec.gated_ffn  # SwiGLU, or GeGLU (a tanh GELU on the gate)
        self.gate = gate_activation(spec)
        if self.gated:
            self.gate_proj = _linear(h, ffn, bias)
            self.up_proj = _linear(h, ffn, bias)
            self.down_proj = _linear(ffn, h, bias)
        else:
            self.fc1 = _linear(h, ffn, bias)
            self.fc2 = _linear(ffn, h, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.down_proj(self.gate(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(F.gelu(self.fc1(x)))


class Stacked(nn.Module):
    """``count`` weights (and biases) of one projection, stacked."""

    def __init__(self, count: int, out: int, inp: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, out, inp))
        self.bias = nn.Parameter(torch.zeros(count, out)) if bias else None


class Router(nn.Module):
    """The routing projection and, for aux-loss-free balancing, a per-expert score bias."""

    def __init__(self, experts: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts)) if bias else None


class StackedExperts(nn.Module):
    """``count`` MLPs stored as stacked ``(count, out, in)`` weights."""

    def __init__(self, spec: ModelSpec, ffn: int, count: int) -> None:
        super().__init__()
        h = spec.hidden_size
        self.gated = spec.gated_ffn
        self.gate = gate_activation(spec)
        self.bias = spec.linear_bias
        shapes = (
            {"gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
            if self.gated
            else {"fc1": (ffn, h), "fc2": (h, ffn)}
        )
        self.count = count
        for name, (out, inp) in shapes.items():
            self.add_module(name, Stacked(count, out, inp, self.bias))

    def _stacked(self, name: str) -> Stacked:
        proj = getattr(self, name)
        assert isinstance(proj, Stacked)
        return proj

    def _mlp(self, project: Callable[[str, Tensor], Tensor], x: Tensor) -> Tensor:
        if self.gated:
            hidden = self.gate(project("gate_proj", x)) * project("up_proj", x)
            return project("down_proj", hidden)
        return project("fc2", F.gelu(project("fc1", x)))

    def expert(self, index: int, x: Tensor) -> Tensor:
        """Expert ``index`` on tokens ``x`` (``(tokens, in)``)."""

        def project(name: str, t: Tensor) -> Tensor:
            proj = self._stacked(name)
            bias = None if proj.bias is None else proj.bias[index]
            return F.linear(t, proj.weight[index], bias)

        return self._mlp(project, x)

    def all_experts(self, x: Tensor) -> Tensor:
        """Every expert on its own slots: ``x`` is ``(count, slots, in)``."""

        def project(name: str, t: Tensor) -> Tensor:
            proj = self._stacked(name)
            # (W x^T)^T, not x W^T: the weight's gradient then comes out in the weight's own
            # layout, where a transposed one would be copied into .grad (two at once)
            y = torch.bmm(proj.weight, t.transpose(1, 2)).transpose(1, 2)
            return y if proj.bias is None else y + proj.bias[:, None, :]

        return self._mlp(project, x)


class _ScaleByRoutingWeights(torch.autograd.Function):
    """``(y * w[..., None]).to(y.dtype)`` for experts' outputs ``y`` ``(E, C, h)`` and routing
    weights ``w`` ``(E, C)``, slab by slab, with the gradients autograd would give.

    Eager autograd makes the product at the weights' precision and, in backward, holds that
    precision's incoming gradient, the experts' outputs' gradient and the unreduced gradient
    of the weights at once: three slot-wide tensors, fp32 ones with DeepSeek's fp32 weights.
    Here the output and the outputs' gradient are the only slot-wide tensors; the rest exists
    one slab of slots at a time: in backward the incoming gradient at the weights' precision
    (a view at 16 bits) and the product the weights' gradient sums. Same values: the same
    elementwise operations and roundings, and each weight's gradient is a sum over its own
    slot's row either way."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(y, w)
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        for at in _slabs(y.shape):
            torch.mul(y[at], w[at].unsqueeze(-1), out=out[at])  # rounded as .to() rounds
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        y, w = ctx.saved_tensors
        need_y, need_w = ctx.needs_input_grad[:2]
        grad_y = torch.empty_like(y) if need_y else None
        grad_w = torch.empty_like(w) if need_w else None
        for at in _slabs(y.shape):
            g = grad[at].to(w.dtype)  # the product's gradient, at the weights' precision
            if grad_w is not None:
                grad_w[at] = (g * y[at]).sum(-1)
            if grad_y is not None:
                torch.mul(g, w[at].unsqueeze(-1), out=grad_y[at])
        return grad_y, grad_w


def _slabs(shape: torch.Size) -> list[tuple[slice, slice]]:
    """(experts, slots) index ranges covering ``(E, C, h)`` with at most
    ``ROUTING_SLAB_ELEMENTS`` elements each, cut as the planner counts them."""
    experts, slots, width = shape
    step, run = routing_slabs(experts, slots, width, ROUTING_SLAB_ELEMENTS)
    return [
        (slice(e, e + step), slice(c, c + run))
        for e in range(0, experts, step)
        for c in range(0, slots, run)
    ]


class MoE(nn.Module):
    """Top-k softmax router with a per-expert capacity; overflowing tokens skip the expert.

    Dispatch has fixed shapes (GShard's): each expert owns ``C = ceil(CF x tokens x top_k / E)``
    slots, filled first come, first served in (token, choice) order; the experts run as one
    batched matmul over ``(E, C, hidden)`` gathered inputs, and the outputs, scaled by their
    routing weights, are added back to their tokens. An empty slot computes on token 0 with
    weight 0. Nothing depends on the routing's values: no host synchronisation on a GPU, the
    memory is the planner's (``moe_dispatch``: fp32 router probabilities, the gathered inputs
    and the expert outputs), and the layer traces under fake tensors.
    """

    def __init__(self, spec: ModelSpec, capacity_factor: float) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        h = spec.hidden_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.routing_weights_fp32 = moe.routing_weights_fp32
        self.capacity_factor = capacity_factor
        self.gate = Router(moe.num_experts, h, moe.router_bias)
        self.experts = StackedExperts(spec, moe.expert_ffn_size, moe.num_experts)
        # the shared experts are one MLP of their summed width (as DeepSeek builds them): the
        # same sum as separate experts, without a per-expert select whose backward would
        # allocate a gradient of every expert's shape
        self.shared_count = moe.num_shared_experts
        self.shared_experts = (
            MLP(spec, moe.num_shared_experts * moe.shared_ffn, bias=spec.linear_bias)
            if moe.num_shared_experts
            else None
        )
        self.shared_expert_gate = _linear(h, 1, False) if moe.shared_expert_gate else None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = F.linear(tokens, self.gate.weight).float()
        probs = logits.softmax(dim=-1)
        bias = self.gate.e_score_correction_bias
        scores = probs if bias is None else probs + bias.float()
        _, chosen = scores.topk(self.top_k, dim=-1)
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        if not self.routing_weights_fp32:
            weights = weights.to(x.dtype)
        slot_token, slot_weight = self.dispatch(chosen, weights)
        gathered = tokens.index_select(0, slot_token).view(self.num_experts, -1, shape[-1])
        # fp32 weights (DeepSeek's) make fp32 products, cast back before they are combined;
        # slab by slab, so no slot-wide fp32 tensor exists (_ScaleByRoutingWeights)
        y = self.experts.all_experts(gathered)
        y = _ScaleByRoutingWeights.apply(y, slot_weight.view(self.num_experts, -1))
        # index_put keeps only the slots' token ids for backward (index_add also keeps its
        # source, one more (E x C, hidden) tensor per MoE layer)
        out = torch.zeros_like(tokens).index_put(
            (slot_token,), y.reshape(-1, shape[-1]), accumulate=True
        )
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.reshape(shape)

    def dispatch(self, chosen: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """(token, routing weight) of each of the ``E x C`` slots, from the top-k choices."""
        experts, k = self.num_experts, self.top_k
        total = chosen.numel()
        capacity = math.ceil(self.capacity_factor * chosen.shape[0] * k / experts)
        flat = chosen.reshape(-1)
        # rank of each choice among its expert's, in (token, choice) order: a stable sort
        # groups the choices by expert, and each group starts where searchsorted says
        ordered, order = flat.sort(stable=True)
        starts = torch.searchsorted(ordered, torch.arange(experts, device=flat.device))
        rank_sorted = torch.arange(total, device=flat.device) - starts[ordered]
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        # overflowing choices all land on one extra slot, dropped below
        slot = torch.where(rank < capacity, flat * capacity + rank, experts * capacity)
        token = torch.arange(chosen.shape[0], device=flat.device).repeat_interleave(k)
        slots = experts * capacity + 1
        slot_token = torch.zeros(slots, dtype=torch.long, device=flat.device).scatter(
            0, slot, token
        )
        slot_weight = weights.new_zeros(slots).scatter(0, slot, weights.reshape(-1))
        return slot_token[:-1], slot_weight[:-1]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, is_moe: bool, capacity_factor: float) -> None:
        super().__init__()
        self.input_layernorm = Norm(spec.hidden_size, spec)
        self.self_attn: nn.Module = (
            LatentAttention(spec) if spec.mla is not None else Attention(spec)
        )
        self.post_attention_layernorm = Norm(spec.hidden_size, spec)
        self.mlp: nn.Module = (
            MoE(spec, capacity_factor) if is_moe else MLP(spec, spec.ffn_hidden_size)
        )

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def rope_tables(
    seq_len: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderLM(nn.Module):
    """Embedding → layers → final norm → head (tied to the embedding when the spec says so)."""

    def __init__(self, spec: ModelSpec, capacity_factor: float = 1.25) -> None:
        super().__init__()
        check_supported(spec)
        self.spec = spec
        self.capacity_factor = capacity_factor
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, spec.is_moe_layer(i), capacity_factor)
            for i in range(spec.num_layers)
        )
        self.norm = Norm(spec.hidden_size, spec)
        self.lm_head = (
            None
            if spec.tied_embeddings
            else _linear(spec.hidden_size, spec.vocab_size, spec.linear_bias)
        )

    def rope(
        self, seq_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        return rope_tables(seq_len, rope_dim(self.spec), dtype, device)

    def head(self, h: Tensor) -> Tensor:
        h = self.norm(h)
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)

    def forward(self, ids: Tensor, checkpoint_every: int | None = None) -> Tensor:
        """Logits; with ``checkpoint_every`` = k, autograd keeps only each k-layer block's
        input and recomputes the block in backward (full recompute is k = 1)."""
        h = self.embed_tokens(ids)
        cos, sin = self.rope(ids.shape[1], h.dtype, h.device)
        if checkpoint_every is None or not torch.is_grad_enabled():
            for layer in self.layers:
                h = layer(h, cos, sin)
            return self.head(h)
        n = len(self.layers)
        for start in range(0, n, checkpoint_every):
            end = min(n, start + checkpoint_every)
            h = checkpoint(self._block, start, end, h, cos, sin, use_reentrant=False)
        return self.head(h)

    def _block(self, start: int, end: int, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        for layer in self.layers[start:end]:
            h = layer(h, cos, sin)
        return h


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class SkipInit(TorchFunctionMode):
    """Modules built under it keep their parameters as allocated (``torch.empty``): the
    functions of ``torch.nn.init`` (a module's ``reset_parameters``) return their tensor
    untouched. The fills would be overwritten; built on the meta device instead, the fills and
    the move to the CPU run torch's Python reference decompositions, which import
    ``torch._dynamo`` and sympy: 1.6 s of CPU in every training process."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            # each of them hands its tensor on by keyword (``tensor=``)
            return kwargs["tensor"] if kwargs and "tensor" in kwargs else args[0]
        return func(*args, **(kwargs or {}))


def build_model(
    spec: ModelSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    capacity_factor: float | None = None,
) -> DecoderLM:
    """A randomly initialised model (normal(0, 0.02) matrices, unit norms, zero biases)."""
    cf = capacity_factor or (spec.moe.capacity_factor if spec.moe else None) or 1.25
    generator = torch.Generator().manual_seed(seed)
    with SkipInit():  # every parameter is set below
        model = DecoderLM(spec, cf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * INIT_STD)
    return model.to(device=device, dtype=dtype)


def synthetic_batch(
    vocab_size: int, micro_batch: int, seq_len: int, step: int, micro: int, seed: int
) -> tuple[Tensor, Tensor]:
    """Deterministic random tokens for (step, micro-batch): inputs and next-token labels."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
