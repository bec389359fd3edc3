"""Megatron-Core's own model code for CPU traces (the ``megatron`` activation profile).

``megatron-core`` is an optional install (``make install`` adds 0.16.1). A model is
Megatron-Core's ``GPTModel`` with its local layer spec (``get_gpt_layer_local_spec``: torch's
RMSNorm or LayerNorm, Megatron's ``ColumnParallelLinear``/``RowParallelLinear`` projections,
its SwiGLU or GeLU MLP, biases on every linear or on Q/K/V only, query/key norms, dropout, and
RoPE; dense models), built from a planner spec with ``use_cpu_initialization`` and random weights,
stepped as Megatron's ``pretrain_gpt`` steps it: the model's own loss from ``labels``
(``vocab_parallel_cross_entropy`` on fp32 logits), averaged over the tokens. Megatron-Core's
parallel state is rank 0 of ``parallel.tp`` tensor-parallel ranks on a fake process group
(sequence parallelism as the spec says), set up and torn down around the trace. Megatron-LM's
defaults for the fusions that change what is kept are on (``--bias-swiglu-fusion``,
``--bias-gelu-fusion`` where the linears have biases, ``--bias-dropout-fusion``), and the
recompute is Megatron's own (:func:`recompute_options`).

**What a CPU cannot run, and only that, is replaced by what a GPU's kernel allocates**
(:func:`as_on_a_gpu`):

- Megatron-Core names the CUDA device where it places a buffer (``torch.cuda.current_device()``:
  the rotary embedding's inverse frequencies, its all-gather buffer): the call answers the CPU.
- Its local attention (``DotProductAttention``) is the unfused math kernel, which keeps every
  score; a real run uses Transformer Engine's fused (flash) attention, which does not build on
  a CPU. The core attention allocates what a flash kernel allocates: the output and an fp32
  log-sum-exp per head and position, saved with the queries, keys and values (grouped keys and
  values not repeated), and in backward an fp32 ``delta`` beside the input gradients.
- torch's ``rms_norm`` on a CPU is its composite form, which keeps an fp32 copy of the input
  and the fp32 normalised rows; CUDA's fused kernel and Transformer Engine's keep the input and
  an fp32 statistic per row (:class:`RMSNormAsOnAGpu`).
- torch's ``dropout`` on a CPU keeps a noise tensor of the input's dtype; CUDA's fused kernel
  keeps a bool mask (:func:`_dropout`).
- Megatron compiles its fused activations with ``torch.compile``: their autograd functions
  (which decide what is kept) run as they are, their compiled bodies as one kernel that
  allocates its output (:data:`COMPILED_KERNELS`); the rest it compiles runs eagerly.
- Its checkpointing saves and restores the CUDA generator's state (for dropout in a re-run):
  the CPU generator's state stands in, and the generators it forks for tensor-parallel regions
  only decide values, which fake tensors do not have.

Transformer Engine's fused layers (``TELayerNormColumnParallelLinear`` and the like) are not
traced: they keep what the local layers keep (the norm's input and output, the GEMM's input).
Megatron's torch norms refuse sequence parallelism (apex's and Transformer Engine's norms mark
their weights for the reduction it needs); the trace builds torch's norms on the local shard,
which keep what those keep.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterator
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
def one_rank(tp: int = 1) -> Iterator[None]:
    """Megatron-Core's parallel state as rank 0 of ``tp`` tensor-parallel ranks (pipeline and
    data parallel 1) on a fake process group, for the block's duration (refused when a process
    group exists). The fake group's collectives move nothing: under fake tensors only their
    outputs' shapes count, which the collectives' own code allocates."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists: a megatron trace needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        parallel_state.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class RMSNormAsOnAGpu(torch.autograd.Function):
    """What a GPU's fused RMSNorm keeps for backward: its input, as it is, and an fp32
    reciprocal root mean square per row (Transformer Engine's ``rmsnorm_fwd``, which saves
    the input and ``rsigma``; torch's CUDA ``_fused_rms_norm``, which saves the input and
    ``rstd``). On a CPU torch's ``rms_norm`` is its composite form, which keeps an fp32 copy of
    the input and the fp32 normalised rows: 8 bytes an element where a GPU keeps 2 in bf16. In
    backward the input's gradient in its dtype and the weight's gradient. Values are never
    read: traces run under fake tensors."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, _rstd, weight = ctx.saved_tensors
        return x.new_empty(x.shape), None if weight is None else weight.new_empty(weight.shape)


def _rms_norm(
    input: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    out: torch.Tensor = RMSNormAsOnAGpu.apply(input, weight)  # type: ignore[no-untyped-call]
    return out


_TORCH_DROPOUT = torch.nn.functional.dropout


def _dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """Dropout as CUDA runs it: ``native_dropout``, which keeps a bool mask (1 byte an
    element). A CPU's ``dropout`` multiplies by a noise tensor of the input's dtype and keeps
    that (2 bytes in bf16): ATen's ``dropout`` takes the fused kernel only for CUDA tensors
    (``is_fused_kernel_acceptable``). Megatron's compiled bias-dropout-add keeps a bool mask
    too. Off (p 0, or not training) it is the input, on either device."""
    if not training or p == 0 or inplace:
        return _TORCH_DROPOUT(input, p, training, inplace)
    out: torch.Tensor = torch.native_dropout(input, p, True)[0]
    return out


def _half(y: torch.Tensor, *_: Any) -> torch.Tensor:
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


def _like(y: torch.Tensor, *_: Any) -> torch.Tensor:
    return y.new_empty(y.shape)


#: Megatron's ``torch.compile``-fused activation kernels (``megatron/core/fusions``) as a GPU
#: runs them: one fused kernel each, which allocates its output and nothing else (run eagerly,
#: their bodies would allocate a tensor per operation). What their autograd functions keep
#: (``GeLUFunction``, ``BiasSwiGLUFunction``, ``SwiGLUFunction``: the input) is unchanged.
COMPILED_KERNELS: dict[str, dict[str, Callable[..., torch.Tensor]]] = {
    "megatron.core.fusions.fused_bias_swiglu": {
        "swiglu": _half,
        "bias_swiglu": _half,
        "swiglu_back": lambda g, y, *_: _like(y),
        "bias_swiglu_back": lambda g, y, *_: _like(y),
    },
    "megatron.core.fusions.fused_bias_gelu": {
        "bias_gelu": lambda bias, y: _like(y),
        "bias_gelu_back": lambda g, bias, y: _like(y),
    },
}


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Megatron-Core's CUDA device query answering the CPU, its core attention allocating what
    a flash kernel does, RMSNorm and dropout keeping what their CUDA kernels keep, and the
    kernels Megatron fuses with ``torch.compile`` run as written (module docstring)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from headroom.calibration.tracing import flash_attention_as_on_a_gpu

    def flash(
        self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
    ) -> torch.Tensor:
        length, batch = query.shape[:2]
        return flash_attention_as_on_a_gpu(query, key, value, "sbhd").view(length, batch, -1)

    from megatron.core.tensor_parallel import random

    functional = torch.nn.functional
    forward, device = DotProductAttention.forward, torch.cuda.current_device
    rms_norm, dropout = functional.rms_norm, functional.dropout
    rng_state = random._get_cuda_rng_state, random._set_cuda_rng_state
    DotProductAttention.forward = flash
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    functional.rms_norm = _rms_norm
    functional.dropout = _dropout
    # Megatron's checkpointing keeps the CUDA generator's state to replay dropout: the CPU's
    random._get_cuda_rng_state = lambda *_, **__: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *_, **__: torch.set_rng_state(state)
    # the generators Megatron forks for dropout in tensor-parallel regions (seeded by its
    # ``pretrain_gpt``) only decide values, which fake tensors do not have
    tracker = random.get_cuda_rng_tracker()
    tracker.fork = lambda *_, **__: contextlib.nullcontext()
    replaced = []
    for name, kernels in COMPILED_KERNELS.items():
        module = importlib.import_module(name)
        for attribute, kernel in kernels.items():
            replaced.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, kernel)
    try:
        # what else Megatron compiles (the bias-dropout-add: its bool mask) runs eagerly
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        DotProductAttention.forward = forward
        torch.cuda.current_device = device
        functional.rms_norm, functional.dropout = rms_norm, dropout
        del tracker.fork
        random._get_cuda_rng_state, random._set_cuda_rng_state = rng_state
        for module, attribute, original in replaced:
            setattr(module, attribute, original)


def recompute_options(selective: bool, every: int | None) -> dict[str, Any]:
    """Megatron's ``TransformerConfig`` recompute options for the planner's policy: selective
    is ``--recompute-granularity selective`` with its default module, the core attention;
    every K layers (full: K = 1) is ``--recompute-granularity full --recompute-method uniform
    --recompute-num-layers K``, which checkpoints each group of K layers' input."""
    if every is not None:
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": every,
        }
    if selective:
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


@contextlib.contextmanager
def _torch_norms_on_the_local_shard() -> Iterator[None]:
    """torch's norms as Megatron wraps them (``WrappedTorchNorm``) on the sequence-parallel
    shard. Megatron refuses them under sequence parallelism, whose norm weights' gradients need
    a reduction over the tensor-parallel ranks that only apex's and Transformer Engine's norms
    mark; those keep what torch's keep (the local shard's input and per-row statistics), so the
    trace builds torch's on the shard and leaves the reduction out (a few norm weights)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def local(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        unsharded = copy.copy(config)
        unsharded.sequence_parallel = False
        return original(cls, unsharded, *args, **kwargs)

    WrappedTorchNorm.__new__ = local
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = original


def build(
    spec: planner.ModelSpec,
    seq_len: int,
    dtype: torch.dtype,
    selective: bool = False,
    every: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> torch.nn.Module:
    """Megatron-Core's GPT of ``spec``'s shape with its local layers, parameters in ``dtype``
    and the recompute of :func:`recompute_options`, as rank 0 of ``tp`` tensor-parallel ranks
    (call it under ``FakeTensorMode``, :func:`one_rank` of ``tp`` and :func:`as_on_a_gpu`)."""
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
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        # Megatron-LM's defaults (--bias-swiglu-fusion, --bias-gelu-fusion, which needs biases,
        # --bias-dropout-fusion): its fused autograd functions keep fewer tensors than the
        # unfused code (SwiGLU: the projection's output only)
        bias_activation_fusion=swiglu or spec.linear_bias,
        bias_dropout_fusion=True,
        # CUDA kernels with no CPU form; the unfused code keeps the same tensors
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **recompute_options(selective, every),
    )
    with _torch_norms_on_the_local_shard():
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
