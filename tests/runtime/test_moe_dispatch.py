"""The MoE layer's fixed-shape dispatch routes, drops and weighs exactly as a per-expert loop
over the tokens each expert was chosen by (first come, first served up to its capacity)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from headroom import planner
from headroom.runtime.model import DecoderLM, MoE, build_model


def _loop_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The routing by data-dependent selection: each expert takes the (token, choice) pairs
    that chose it, in order, up to capacity."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.linear(tokens, moe.gate.weight).float().softmax(dim=-1)
    bias = moe.gate.e_score_correction_bias
    scores = probs if bias is None else probs + bias.float()
    _, chosen = scores.topk(moe.top_k, dim=-1)
    weights = probs.gather(-1, chosen)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    capacity = math.ceil(moe.capacity_factor * tokens.shape[0] * moe.top_k / moe.num_experts)
    out = torch.zeros_like(tokens)
    for e in range(moe.num_experts):
        token_idx, slot = (chosen == e).nonzero(as_tuple=True)
        token_idx, slot = token_idx[:capacity], slot[:capacity]
        y = moe.experts.expert(e, tokens[token_idx]) * weights[token_idx, slot, None]
        out = out.index_add(0, token_idx, y)
    shared = moe.shared_experts
    if shared is not None:
        # each shared expert on its own: its rows of gate/up and its columns of down
        width = shared.down_proj.in_features // moe.shared_count
        for i in range(moe.shared_count):
            rows = slice(i * width, (i + 1) * width)
            hidden = F.silu(tokens @ shared.gate_proj.weight[rows].T) * (
                tokens @ shared.up_proj.weight[rows].T
            )
            out = out + hidden @ shared.down_proj.weight[:, rows].T
    return out.reshape(x.shape)


def _moe(capacity_factor: float, **moe: object) -> MoE:
    spec = planner.load_model("tiny-moe")
    spec = planner.ModelSpec.model_validate(
        {**spec.model_dump(), "moe": {**spec.moe.model_dump(), **moe}}  # type: ignore[union-attr]
    )
    model = build_model(spec, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    layer.capacity_factor = capacity_factor
    return layer


@pytest.mark.parametrize(
    ("capacity_factor", "moe"),
    [
        (1.25, {}),
        (0.5, {}),  # most experts overflow: drops decide the output
        (0.75, {"router_bias": True, "num_shared_experts": 2}),
    ],
)
def test_dispatch_matches_the_per_expert_loop(capacity_factor: float, moe: dict) -> None:
    layer = _moe(capacity_factor, **moe)
    if layer.gate.e_score_correction_bias is not None:
        with torch.no_grad():
            layer.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(2, 24, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    grads = []
    outs = []
    for forward in (layer.forward, lambda t: _loop_forward(layer, t)):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = forward(xi)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        assert xi.grad is not None
        grads.append([xi.grad] + [p.grad for p in layer.parameters() if p.grad is not None])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_overflowing_choices_are_dropped_in_token_order() -> None:
    layer = _moe(1.0)
    experts, k = layer.num_experts, layer.top_k
    tokens = 2 * experts
    chosen = torch.stack(
        [torch.zeros(tokens, dtype=torch.long), torch.ones(tokens, dtype=torch.long)], 1
    )[:, :k]
    weights = torch.rand(tokens, k)
    slot_token, slot_weight = layer.dispatch(chosen, weights)
    capacity = math.ceil(tokens * k / experts)
    assert slot_token.shape == (experts * capacity,)
    # expert 0 takes the first `capacity` tokens; the rest of its choosers are dropped
    assert slot_token[:capacity].tolist() == list(range(capacity))
    assert torch.equal(slot_weight[:capacity], weights[:capacity, 0])
    assert slot_weight[2 * capacity :].abs().sum() == 0  # unchosen experts: empty slots


def test_the_moe_model_runs_under_fake_tensors() -> None:
    spec = planner.load_model("tiny-moe")
    with FakeTensorMode():
        model = DecoderLM(spec, 1.25)  # uninitialised: fake tensors hold no values
        ids = torch.randint(0, spec.vocab_size, (2, 16))
        logits = model(ids)
        logits.sum().backward()
        assert logits.shape == (2, 16, spec.vocab_size)
        assert all(p.grad is not None for p in model.parameters())


def test_routed_experts_keep_two_slot_tensors_and_make_gradients_in_place() -> None:
    """The routed experts save the gathered inputs and their outputs (the planner's dispatch
    buffers) and their FFN-width intermediates, and nothing else slot-sized (index_add would
    also keep its source). Their stacked weights' gradients come out in the weights' layout,
    so the backward never holds a second copy of one (a transposed product would be copied
    into ``.grad``)."""

    layer = _moe(1.25, num_experts=8, top_k=2, num_shared_experts=0, expert_ffn_size=96)
    hidden = layer.gate.weight.shape[1]
    x = torch.randn(1, 64, hidden, requires_grad=True)
    slots = layer.num_experts * math.ceil(1.25 * 64 * 2 / 8)
    sizes: dict[int, torch.Size] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes[t.untyped_storage().data_ptr()] = t.shape
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    assert out.shape == x.shape  # (alive: its saved tensors' storages are not reused)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = [s.numel() for k, s in sizes.items() if k not in params]
    # gathered inputs and expert outputs; gate, SiLU and up outputs and their product
    assert kept.count(slots * hidden) == 2, kept
    assert kept.count(slots * 96) == 4, kept

    # few tokens and wide experts: the weights' gradients dwarf every token-sized temporary
    layer = _moe(1.25, num_experts=8, top_k=2, num_shared_experts=0, expert_ffn_size=512)
    peak, weights = _backward_peak(layer)
    largest = max(p.numel() for p in layer.experts.parameters()) * 4
    # at the peak: the weights, their gradients and token-sized tensors, no second gradient
    assert peak < 2 * weights + largest // 2


def test_shared_experts_make_their_gradients_in_place() -> None:
    """Two shared experts run as one MLP of their summed width: their gradients come out in
    the weights' own tensors. Selecting each expert from a stacked weight would make each
    select's backward allocate a gradient of the whole stack."""
    layer = _moe(1.25, num_experts=2, top_k=1, num_shared_experts=2, expert_ffn_size=8)
    shared = layer.shared_experts
    assert shared is not None
    hidden = layer.gate.weight.shape[1]
    wide = planner.ModelSpec.model_validate(
        {**planner.load_model("tiny-moe").model_dump(), "hidden_size": hidden}
    )
    layer.shared_experts = shared = type(shared)(wide, 2 * 1024, bias=False)
    peak, weights = _backward_peak(layer)
    largest = max(p.numel() for p in shared.parameters()) * 4
    assert all(p.grad is not None for p in shared.parameters())
    # the weights, their gradients and token-sized tensors: no gradient of a whole stack
    assert peak < 2 * weights + largest // 2, (peak, weights, largest)


def _backward_peak(layer: MoE) -> tuple[int, int]:
    """(peak bytes of a forward and backward of four tokens, the layer's weight bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(layer)
    with tracker:
        x = torch.randn(1, 4, layer.gate.weight.shape[1], requires_grad=True)
        layer(x).pow(2).sum().backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak["Total"], sum(p.numel() for p in layer.parameters()) * 4
