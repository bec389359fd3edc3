"""What the runtime's attention keeps of grouped keys and values (GQA): themselves, at
``kv_heads`` width, with 16-bit activations; copies repeated per query head in fp32, as on a GPU,
where no fused kernel takes them grouped at 4 bytes. The planner counts the same."""

from __future__ import annotations

import pytest
import torch

from headroom import planner
from headroom.planner.activations import layer_activations
from headroom.planner.coefficients import default_coefficients
from headroom.runtime.model import Attention, rope_tables

SPEC = planner.ModelSpec(
    name="gqa", vocab_size=256, hidden_size=128, num_layers=1, num_heads=8, num_kv_heads=2,
    ffn_hidden_size=256,
)  # fmt: skip


def _saved_widths(dtype: torch.dtype) -> list[int]:
    """Head counts of the (batch, heads, seq, head_dim) storages one attention forward saves
    (its output shares its storage with the output projection's input, which is 3-D)."""
    attention = Attention(SPEC).to(dtype)
    b, s, d = 2, 16, SPEC.dim_per_head
    cos, sin = rope_tables(s, d, dtype, torch.device("cpu"))
    x = torch.randn(b, s, SPEC.hidden_size, dtype=dtype, requires_grad=True)
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(x, cos, sin)
    out.float().sum().backward()  # the gradient reaches the input either way
    assert x.grad is not None and x.grad.shape == x.shape
    return sorted(
        t.shape[1] for t in saved.values() if t.dim() == 4 and (t.shape[0], t.shape[-1]) == (b, d)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_attention_keeps_grouped_keys_and_values(dtype: torch.dtype) -> None:
    # the queries at query width; the keys and values at kv width, never repeated
    assert _saved_widths(dtype) == [SPEC.kv_heads, SPEC.kv_heads, SPEC.num_heads]


def test_fp32_attention_keeps_keys_and_values_repeated_per_query_head() -> None:
    assert _saved_widths(torch.float32) == [SPEC.num_heads] * 3


def test_the_planner_counts_repeated_keys_and_values_in_fp32_only() -> None:
    coeffs = default_coefficients("textbook")
    tokens, heads, kv, d = 2 * 16, SPEC.num_heads, SPEC.kv_heads, SPEC.dim_per_head

    def dense(e: int) -> int:
        return layer_activations(SPEC, coeffs, 2, 16, e, False, 1, 1, 1, False, 1.25, 1.0).dense

    # everything else is e bytes per element: the fp32 layer has twice the 16-bit one's bytes
    # plus the repeated keys and values
    assert dense(4) - 2 * dense(2) == 2 * tokens * (heads - kv) * d * 4


def test_latent_attention_keeps_its_values_and_not_the_whole_up_projection() -> None:
    """MLA's keys and values come from one up-projection, ``heads x (nope + v)`` wide, and a
    GPU's memory-efficient kernel saves the value it is given for backward. Given a view, it
    kept the whole projection alive (DeepSeek-V3: 32 KiB a token a layer more than the
    planner counts); the trainer gives it a copy, ``heads x v`` wide, and the keys' half goes
    with their concatenation. Traced as the calibration traces: fake tensors, the GPU's
    kernel choice."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from headroom.calibration.tracing import gpu_attention_kernels
    from headroom.runtime.model import LatentAttention, rope_dim

    spec = planner.load_model("tiny-mla")
    mla = spec.mla
    assert mla is not None
    wide = mla.qk_nope_head_dim + mla.v_head_dim
    assert wide not in (mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
    dtype = torch.bfloat16
    b, s, heads = 2, 16, spec.num_heads
    storages: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.append(t.untyped_storage().nbytes())
        return t

    previous = torch.get_default_dtype()
    with FakeTensorMode(), gpu_attention_kernels():
        torch.set_default_dtype(dtype)
        try:
            attention = LatentAttention(spec)
        finally:
            torch.set_default_dtype(previous)
        cos, sin = rope_tables(s, rope_dim(spec), dtype, torch.device("cpu"))
        x = torch.randn(b, s, spec.hidden_size, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attention(x, cos, sin)
    element = torch.finfo(dtype).bits // 8
    assert b * s * heads * mla.v_head_dim * element in storages  # the values, saved
    assert b * s * heads * wide * element not in storages  # and nothing of their width
