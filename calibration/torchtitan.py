"""torchtitan's own model code for CPU traces (the ``torchtitan`` activation profile).

``torchtitan`` is an optional install (``make install`` adds it: ``torchtitan==0.3.0`` without
its data, logging and checkpoint dependencies, which no trace uses; its import needs
``triton``, whose kernels only its asynchronous expert parallelism runs). A model is
torchtitan's Llama 3 (``torchtitan.models.llama3``): its decoder, its fused Q/K/V projection,
its complex RoPE, its SwiGLU feed-forward and its FlexAttention, built from the layer configs
torchtitan's own flavors are built from (``_build_llama3_layers``) with the shape of a planner
spec, random weights, in train mode. The loss is torchtitan's ``cross_entropy_loss`` (the
logits upcast to fp32, summed), the positions ``0 .. seq_len - 1`` in every row and the
attention masks torchtitan's (``Decoder.get_attention_masks``: one document per row, causal),
and ``recompute: full`` is torchtitan's ``FullAC`` on every block.

**FlexAttention on a CPU.** torchtitan's language models run attention only in FlexAttention
(``flex``, ``flex_flash``) or varlen, all GPU kernels: FlexAttention refuses a backward on CPU
tensors and runs eagerly only through ``torch.compile``, which a memory tracker's dispatch mode
cannot enter. For a trace, torchtitan's compiled FlexAttention call
(``FlexAttention._compiled_flex_attn``) is replaced by
``calibration.tracing.FlashAttentionAsOnAGpu``, which allocates what the compiled GPU kernels
allocate and nothing else (read from ``torch/_higher_order_ops/flex_attention.py`` and
``torch/_inductor/kernel/flex/flex_attention.py``): the output, in the queries' dtype, and an
fp32 log-sum-exp per query head and position, saved with the queries, keys and values (grouped
keys and values are not repeated); in backward an fp32 ``delta`` of the same size and the
three input gradients. Everything else is torchtitan's code,
unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from headroom import planner
from headroom.planner.errors import SpecError

#: torchtitan's Llama 3 flavors (``torchtitan.models.llama3.llama3_configs``)
FLAVORS = ("debugmodel", "1B", "3B", "8B", "70B", "405B")


def require_torchtitan() -> Any:
    """The ``torchtitan.models.llama3`` module, or a SpecError naming ``impl``."""
    try:
        import torchtitan.models.llama3 as llama3
    except ImportError as exc:
        raise SpecError(
            "impl: torchtitan needs the torchtitan package (and triton, which it imports); "
            f"make install adds both, or use --impl hf ({exc})",
            field="impl",
        ) from None
    return llama3


def _refuse(field: str, why: str) -> SpecError:
    return SpecError(
        f"model.{field}: a torchtitan trace builds torchtitan's Llama 3; {why}",
        field=f"model.{field}",
    )


def llama_refusal(spec: planner.ModelSpec) -> tuple[str, str] | None:
    """The first field of ``spec`` a dense Llama decoder (torchtitan's Llama 3, torchtune's
    Llama 3.2) cannot express and why, or None: SwiGLU, RMSNorm, grouped-query attention
    whose heads split the width, no biases, no dropout, no query/key norms, no MoE, MLA or
    multi-token prediction."""
    checks = (
        ("ffn_kind", spec.ffn_kind == "swiglu", "its MLP is SwiGLU (allowed: swiglu)"),
        ("norm", spec.norm == "rmsnorm", "its norms are RMSNorm (allowed: rmsnorm)"),
        ("moe", spec.moe is None, "it is dense (allowed: null)"),
        ("mla", spec.mla is None, "its attention is grouped-query (allowed: null)"),
        ("qk_norm", not spec.qk_norm, "it has no query/key norms (allowed: false)"),
        ("qkv_bias", not spec.qkv_bias, "its projections have no bias (allowed: false)"),
        ("attention_out_bias", not spec.attention_out_bias, "no bias (allowed: false)"),
        ("mlp_bias", not spec.mlp_bias, "no bias (allowed: false)"),
        ("linear_bias", not spec.linear_bias, "no bias (allowed: false)"),
        ("dropout", not spec.dropout, "no dropout (allowed: false)"),
        ("num_mtp_layers", spec.num_mtp_layers == 0, "no multi-token prediction (allowed: 0)"),
    )
    for field, ok, why in checks:
        if not ok:
            return field, why
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    if head_dim * spec.num_heads != spec.hidden_size:
        return (
            "head_dim",
            f"its heads split the width (allowed: {spec.hidden_size // spec.num_heads})",
        )
    return None


def config_for(spec: planner.ModelSpec, seq_len: int = 131072) -> Any:
    """torchtitan's ``Llama3Model.Config`` of ``spec``'s shape (a SpecError naming the first
    field Llama 3 cannot express), its RoPE caches ``seq_len`` positions long as torchtitan's
    trainer makes them (``Decoder.Config.update_from_config``: the training sequence length;
    every block keeps a cache of its own)."""
    llama3 = require_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    refusal = llama_refusal(spec)
    if refusal is not None:
        raise _refuse(*refusal)
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    dim, vocab = spec.hidden_size, spec.vocab_size
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=spec.num_layers,
        dim=dim,
        n_heads=spec.num_heads,
        n_kv_heads=spec.num_kv_heads or spec.num_heads,
        hidden_dim=spec.ffn_hidden_size,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=spec.tied_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers,
    )


def flavor_spec(
    flavor: str, num_layers: int | None = None, name: str | None = None
) -> planner.ModelSpec:
    """The planner's spec of torchtitan's Llama 3 ``flavor`` (cut to ``num_layers``), read off
    torchtitan's own config."""
    llama3 = require_torchtitan()
    if flavor not in FLAVORS:
        raise SpecError(f"flavor: allowed: {', '.join(FLAVORS)} (got {flavor!r})", field="flavor")
    cfg = llama3.llama3_configs[flavor](attn_backend="flex")
    attention = cfg.layers[0].attention
    ffn = cfg.layers[0].feed_forward
    return planner.ModelSpec(
        name=name or f"torchtitan-llama3-{flavor}",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_layers=num_layers or len(cfg.layers),
        num_heads=attention.n_heads,
        num_kv_heads=attention.n_kv_heads or attention.n_heads,
        ffn_hidden_size=ffn.w1.out_features,
        tied_embeddings=cfg.enable_weight_tying,
        source=f"torchtitan.models.llama3.llama3_configs[{flavor!r}]",
    )


def build(config: Any) -> torch.nn.Module:
    """torchtitan's Llama 3 of ``config``, in the current default dtype and device mode (call it
    under ``FakeTensorMode`` to allocate nothing), in train mode."""
    net: torch.nn.Module = config.build()
    return net.train()


def apply_full_ac(net: torch.nn.Module) -> None:
    """torchtitan's full activation checkpointing (``FullAC``) on every block."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC.Config().build().apply(net)


def apply_selective_op_ac(net: torch.nn.Module) -> None:
    """torchtitan's per-op selective activation checkpointing (``SelectiveAC``, its trainer's
    default) on every block, with its own save list and policy: each block's forward runs under
    ``create_selective_checkpoint_contexts`` and keeps the outputs of the ops its policy saves
    (every odd-numbered ``mm``/``linear`` of the block, attention, the other listed ops); its
    backward re-runs the block, taking those outputs from the cache."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    SelectiveAC.Config().build().apply(net)


def attention_masks(net: Any, batch: int, seq_len: int) -> Any:
    """torchtitan's attention masks of ``batch`` rows of one document each, made as its trainer
    makes them (``get_attention_masks`` of the positions), outside any fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        positions = torch.arange(seq_len).expand(batch, seq_len)
        return net.get_attention_masks(positions=positions)


def loss(net: Any, ids: torch.Tensor, masks: Any) -> torch.Tensor:
    """torchtitan's forward and loss of a batch (``cross_entropy_loss``, summed; the trainer
    divides by the tokens, which no byte depends on)."""
    from torchtitan.components.loss import cross_entropy_loss

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = net(ids, positions, masks)
    out: torch.Tensor = cross_entropy_loss(logits, ids) / ids.numel()
    return out


@contextlib.contextmanager
def flex_attention_as_on_a_gpu(compiled_region: bool = False) -> Iterator[None]:
    """torchtitan's FlexAttention call allocating what the GPU kernels do (module docstring);
    with ``compiled_region`` its forward is one compiled region, as a dispatch mode sees it on
    a GPU (``calibration.tracing.compiled_attention_region``)."""
    from torch.nn.attention.flex_attention import AuxOutput
    from torchtitan.models.common.attention import FlexAttention

    from headroom.calibration.tracing import flash_attention_as_on_a_gpu

    original = FlexAttention.__dict__["_compiled_flex_attn"]

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        out = flash_attention_as_on_a_gpu(q, k, v, "bhsd", compiled_region)
        if kwargs.get("return_aux") is not None and kwargs["return_aux"].lse:
            raise NotImplementedError("a trace's attention returns no log-sum-exp")
        return out, AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(flex)
    try:
        yield
    finally:
        FlexAttention._compiled_flex_attn = original


def cut(config: Any, num_layers: int) -> Any:
    """``config`` with its first ``num_layers`` blocks."""
    return dataclasses.replace(config, layers=list(config.layers[:num_layers]))
