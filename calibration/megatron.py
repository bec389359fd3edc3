"""Megatron-Core's own model code for CPU traces (the ``megatron`` activation profile).

``megatron-core`` is an optional install (``make install`` adds 0.16.1). A model is
Megatron-Core's ``GPTModel`` with its local layer spec (``get_gpt_layer_local_spec``: torch's
RMSNorm or LayerNorm, Megatron's ``ColumnParallelLinear``/``RowParallelLinear`` projections,
its SwiGLU or GeLU MLP, biases on every linear or on Q/K/V only, query/key norms, dropout, and
RoPE; dense models), built from a planner spec with ``use_cpu_initialization`` and random weights,
stepped as Megatron's ``pretrain_gpt`` steps it: the model's own loss from ``labels``
(``vocab_parallel_cross_entropy`` on fp32 logits), averaged over the tokens. Megatron-Core's
parallel state is one rank on a fake process group, set up and torn down around the trace.

**What a CPU cannot run.** Megatron-Core names the CUDA device where it places a buffer
(``torch.cuda.current_device()``: the rotary embedding's inverse frequencies), so for a trace
that call answers the CPU. Its local attention (``DotProductAttention``) is the unfused math
kernel, which keeps every score; a real run uses Transformer Engine's fused (flash) attention,
which Transformer Engine does not build on a CPU. The trace replaces the core attention, and
only it, with one that allocates what a flash kernel allocates: the output and an fp32
log-sum-exp per head and position, saved with the queries, keys and values (grouped keys and
values not repeated), and in backward an fp32 ``delta`` beside the input gradients.
Transformer Engine's fused layers (``TELayerNormColumnParallelLinear`` and the like) are not
traced: the profile is Megatron-Core's local layers with flash attention. ``recompute: full``
runs Megatron's own checkpointing, which saves and restores CUDA RNG states; it is refused
(exit 2, naming ``recompute``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from headroom import planner
from headroom.planner.errors import SpecError


def require_megatron() -> Any:
    """The ``megatron.core`` module, or a SpecError naming ``impl``."""
    try:
        import megatron.core as core
    except ImportError as exc:
        raise SpecError(
            f"impl: megatron needs the megatron-core package; make install adds it ({exc})",
            field="impl",
        ) from None
    return core


def _refuse(field: str, why: str) -> SpecError:
    return SpecError(
        f"model.{field}: a megatron trace builds Megatron-Core's GPT with its local layers; {why}",
        field=f"model.{field}",
    )


def check_model(spec: planner.ModelSpec) -> None:
    """A SpecError naming the first field Megatron-Core's local GPT layers cannot express."""
    partial_bias = (spec.attention_out_bias or spec.mlp_bias) and not spec.linear_bias
    checks = (
        ("moe", spec.moe is None, "traced dense (allowed: null)"),
        ("mla", spec.mla is None, "its attention is grouped-query (allowed: null)"),
        (
            "attention_out_bias" if spec.attention_out_bias else "mlp_bias",
            not partial_bias,
            "Megatron biases every linear (linear_bias) or Q, K and V only (qkv_bias); "
            "allowed: false",
        ),
        ("num_mtp_layers", spec.num_mtp_layers == 0, "no multi-token prediction (allowed: 0)"),
    )
    for field, ok, why in checks:
        if not ok:
            raise _refuse(field, why)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """Megatron-Core's parallel state as one rank (tensor, pipeline and data parallel 1) on a
    fake process group, for the block's duration (refused when a process group exists)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists: a megatron trace needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Megatron-Core's CUDA device query answering the CPU, and its core attention allocating
    what a flash kernel does (module docstring)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from headroom.calibration.tracing import flash_attention_as_on_a_gpu

    def flash(
        self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
    ) -> torch.Tensor:
        length, batch = query.shape[:2]
        return flash_attention_as_on_a_gpu(query, key, value, "sbhd").view(length, batch, -1)

    forward, device = DotProductAttention.forward, torch.cuda.current_device
    DotProductAttention.forward = flash
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        DotProductAttention.forward = forward
        torch.cuda.current_device = device


def build(spec: planner.ModelSpec, seq_len: int, dtype: torch.dtype) -> torch.nn.Module:
    """Megatron-Core's GPT of ``spec``'s shape with its local layers, parameters in ``dtype``
    (call it under ``FakeTensorMode`` and :func:`one_rank`)."""
    require_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_model(spec)
    swiglu = spec.ffn_kind == "swiglu"
    norm = "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm"
    dropout = 0.1 if spec.dropout else 0.0
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads or spec.num_heads,
        kv_channels=spec.head_dim or spec.hidden_size // spec.num_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        normalization=norm,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias or spec.linear_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        # the fused kernels are CUDA's; their unfused forms hold the same tensors
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    net = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            qk_layernorm=spec.qk_norm, normalization=norm
        ),
        vocab_size=spec.vocab_size,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=spec.tied_embeddings,
    )
    trained: torch.nn.Module = net.train()
    return trained


def loss(net: Any, ids: torch.Tensor) -> torch.Tensor:
    """Megatron's forward and loss of a batch: the per-token loss from ``labels``, averaged."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    per_token: torch.Tensor = net(ids, positions, None, labels=ids)
    return per_token.sum() / ids.numel()
