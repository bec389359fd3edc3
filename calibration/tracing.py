"""Measure a training step's memory on a CPU, without a GPU, and compare it per bucket.

Two optimizer steps (torch AdamW over the working parameters) of a model run under PyTorch's
per-category memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``). The model is

- ``runtime``: the trainer's own (``runtime.model.DecoderLM``, its ``none`` placement), under
  ``FakeTensorMode``: no memory is allocated, so full-width layers trace in seconds. Its MoE
  layers dispatch into fixed ``(experts, capacity)`` slots, so no shape depends on the routing
  and MoE models trace under fake tensors as dense ones do.
- ``hf``: a transformers model built from a config with random weights (``calibration.hf``).
  transformers' default experts implementation sorts the tokens by expert into buffers whose
  shapes do not depend on the routing, so dense and MoE models both trace under fake tensors.

The tracker's categories map to the planner's buckets: Parameter and Buffer → ``params``,
Gradient → ``grads``, Optstate → ``optimizer_states``; Activation, Temp and Other are the
step's transient tensors, compared with the planner's ``activations`` + ``logits`` +
``moe_dispatch`` (the tracker does not tell logits from other activations). The tracker's
per-module statistics also give each decoder layer's backward peak (``layer_backward_peaks``),
which the layers' backward terms are fitted to.

The optimizer is ``torch.optim.AdamW`` with the spec's ``optimizer_impl`` (for_loop, foreach or
fused). Precision: the trace runs what torch AdamW does, so the training spec must say so: working
parameters, gradients and optimizer states in one precision (fp32 or bf16) and no separate
master copy. Other specs are refused, naming ``precision``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from headroom import planner
from headroom.calibration.comparison import COMPARED
from headroom.planner.errors import SpecError
from headroom.runtime.adam import torch_adamw
from headroom.runtime.model import DecoderLM, loss_fn
from headroom.runtime.support import TORCH_DTYPE, check_supported
from headroom.runtime.trainer import DTYPES

#: tracker category → planner bucket ("transient" is compared with TRANSIENT_BUCKETS)
CATEGORY_BUCKET = {
    "Parameter": "params",
    "Buffer": "params",
    "Gradient": "grads",
    "Optstate": "optimizer_states",
    "Activation": "transient",
    "Temp": "transient",
    "Other": "transient",
}


def check_traceable(train: planner.TrainSpec, impl: str = "runtime") -> torch.dtype:
    """The working dtype of a spec the trace can run (see the module docstring). Megatron-Core
    shards its own layers: ``impl`` megatron traces rank 0 of ``parallel.tp`` ranks, with or
    without sequence parallelism."""
    p = train.precision
    # the trainer's working precisions (``headroom train --dtype``)
    if p.master != "none" or not (p.params == p.grads == p.optimizer_states in TORCH_DTYPE):
        raise SpecError(
            "precision: a trace runs torch AdamW on the working parameters; set params, grads "
            "and optimizer_states to one of fp32, bf16 and master to none "
            f"(got {p.model_dump()})",
            field="precision",
        )
    if train.optimizer != "adamw":
        raise SpecError(
            f"optimizer: a trace runs torch AdamW; allowed: adamw (got {train.optimizer})",
            field="optimizer",
        )
    if train.offload.mode != "none":
        raise SpecError(
            "offload.mode: a trace runs the trainer's resident placement; allowed: none "
            f"(got {train.offload.mode})",
            field="offload.mode",
        )
    parallel = train.parallel
    tp = parallel.tp if impl == "megatron" else 1
    if parallel.dp * parallel.tp * parallel.pp * parallel.cp > tp:
        allowed = "tp (and sequence_parallel) only" if impl == "megatron" else "none"
        raise SpecError(
            f"parallel: a trace runs one rank; parallelism allowed for --impl {impl}: {allowed}",
            field="parallel",
        )
    return DTYPES[p.params]


def _categories(snapshot: dict[Any, dict[str, int]]) -> dict[str, int]:
    out = dict.fromkeys(COMPARED, 0)
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            bucket = CATEGORY_BUCKET.get(category)
            if bucket is not None:
                out[bucket] += int(nbytes)
    out["total"] = sum(out[b] for b in COMPARED)
    return out


IMPLS = ("runtime", "hf", "torchtitan", "megatron", "torchtune")


@contextlib.contextmanager
def gpu_attention_kernels() -> Iterator[None]:
    """Scaled-dot-product attention with a GPU's kernel choice where a CPU's differs.

    A GPU runs attention whose values are narrower than its queries and keys (DeepSeek's
    multi-head latent attention: 192 against 128) in the memory-efficient kernel, which keeps
    the output and its log-sum-exp; the CPU has no such kernel and falls back to the math
    one, which keeps every score. Under fake tensors the memory-efficient kernel's own
    operator runs on CPU tensors (its shapes are all the trace needs), so for those calls the
    trace holds what the GPU would: everything else goes to SDPA unchanged."""
    original = F.scaled_dot_product_attention

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.shape[-1] != value.shape[-1] and attn_mask is None and key.shape == query.shape:
            out: tuple[torch.Tensor, ...] = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, dropout_p, is_causal, scale=scale
            )
            return out[0]
        return original(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class FlashAttentionAsOnAGpu(torch.autograd.Function):
    """What a GPU's flash-style attention kernel allocates, for fake-tensor traces of model
    code whose attention only runs on a GPU (torchtitan's FlexAttention, Transformer Engine's
    fused attention under Megatron-Core): the output, in the queries' dtype, and an fp32
    log-sum-exp per query head and position, saved with the queries, keys and values (grouped
    keys and values not repeated); in backward an fp32 ``delta`` of the same size (the
    kernels' ``sum(out * grad_out)``) beside the three input gradients
    (``torch/_higher_order_ops/flex_attention.py``: ``flex_attention_fake_impl``,
    ``FlexAttentionAutogradOp``; ``torch/_inductor/kernel/flex/flex_attention.py``: the
    backward's ``delta``). ``layout`` is ``"bhsd"`` (batch, heads, sequence, head_dim) or
    ``"sbhd"``. Values are never read: traces run under fake tensors.

    ``compiled``: the forward runs as ``torch.compile``'s compiled code runs under a dispatch
    mode (``compiled_attention_region``), as torchtitan's compiled FlexAttention does on a
    GPU."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, compiled: bool
    ) -> torch.Tensor:
        if compiled:
            # what AOTAutograd's compiled function saves: the region's outputs
            out, q, k, v, lse = compiled_attention_region(q, k, v, layout)
        else:
            out, lse = _attention_outputs(q, k, v, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, lse = ctx.saved_tensors
        delta = lse.new_empty(lse.shape)
        grads = (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None, None)
        del delta
        return grads


def _attention_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernels' forward outputs: the output and the fp32 log-sum-exp."""
    if layout == "bhsd":
        batch, heads, length = q.shape[:3]
    else:
        length, batch, heads = q.shape[:3]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty((batch, heads, length), dtype=torch.float32)
    return out, lse


@functools.cache
def _compiled_attention(layout: str) -> Any:
    """The attention's forward as one compiled region (one object per layout, as torch.compile
    makes one per graph: selective checkpointing keys its cache by it)."""
    from torch._higher_order_ops.wrap import InductorCompiledCallable

    def region(*inputs: torch.Tensor) -> list[torch.Tensor]:
        q, k, v = inputs
        out, lse = _attention_outputs(q, k, v, layout)
        # AOTAutograd's forward graph of flex_attention returns the output, the inputs its
        # backward needs (as they are, not copied) and the log-sum-exp
        return [out, q, k, v, lse]

    return InductorCompiledCallable(lambda inputs: region(*inputs), region)


def compiled_attention_region(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str
) -> list[torch.Tensor]:
    """The attention's forward as torch.compile runs compiled code under a dispatch mode with
    ``wrap_inductor_compiled_regions`` (torchtitan sets it for its FlexAttention): one
    ``inductor_compiled_code`` operator whose outputs are the compiled forward graph's (the
    output, the queries, keys and values as they are, the log-sum-exp). A dispatch mode sees
    that one operator: torchtitan's per-op checkpointing policy names it in its save list, so
    under ``SelectiveAC`` all five are kept for the block's backward, as on a GPU.

    Two rules a trace adds for the operator: PyTorch's memory trackers have none, so it is
    passed to them as one operator (as torch passes it to its own debug and checkpointing
    modes); and FakeTensorMode's dispatch cache, which would rebuild the outputs of a repeated
    call as new tensors, even those that are its inputs (a fake-tensor artifact: the compiled
    code returns its inputs as they are), is bypassed for it."""
    from torch._higher_order_ops.utils import hops_that_skip_faketensor_cache, redirect_to_mode
    from torch._higher_order_ops.wrap import inductor_compiled_code

    # (torch annotates the set with operator overloads; its own register_fake adds HOPs too)
    hops_that_skip_faketensor_cache.add(inductor_compiled_code)  # type: ignore[arg-type]
    rules = inductor_compiled_code.python_key_table
    for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack():
        if isinstance(mode, MemTracker) and type(mode) not in rules:
            redirect_to_mode(inductor_compiled_code, type(mode))
    outputs: list[torch.Tensor] = inductor_compiled_code(_compiled_attention(layout), [q, k, v])
    return outputs


def flash_attention_as_on_a_gpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, compiled: bool = False
) -> torch.Tensor:
    """:class:`FlashAttentionAsOnAGpu` applied."""
    out: torch.Tensor = FlashAttentionAsOnAGpu.apply(q, k, v, layout, compiled)  # type: ignore[no-untyped-call]
    return out


def _build(
    impl: str, model: planner.ModelSpec, train: planner.TrainSpec, config: dict[str, Any] | None
) -> tuple[Any, Callable[[Any, torch.Tensor], torch.Tensor]]:
    """(module, loss of a batch) for ``impl``."""
    # layers per recomputed block as the planner reads the spec (selective recomputes the
    # attention scores, which scaled-dot-product attention never keeps: it traces as none)
    every = planner.knobs(train).checkpoint_every
    if train.recompute == "selective_op" and impl != "torchtitan":
        raise SpecError(
            "recompute: selective_op is torchtitan's per-op selective checkpointing (its "
            f"SelectiveAC), which only torchtitan's model code runs; allowed for --impl {impl}: "
            "none, selective, full or every_k (or use --impl torchtitan)",
            field="recompute",
        )
    if impl == "hf":
        from headroom.calibration import hf

        if every not in (None, 1):
            raise SpecError(
                "recompute: transformers checkpoints every layer; allowed for --impl hf: "
                f"none, selective, full (got every_k {every})",
                field="recompute",
            )
        cfg = config if config is not None else hf.config_for(model)
        net = hf.build(cfg)
        if every == 1:  # every layer checkpointed (its every_n_layers is not a block size)
            kwargs = {"use_reentrant": False}
            if hasattr(net, "activation_checkpointing_enable"):  # newer transformers
                net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return net, lambda m, ids: m(input_ids=ids, labels=ids).loss
    if impl == "torchtitan":
        from headroom.calibration import torchtitan

        if every not in (None, 1):
            raise SpecError(
                "recompute: torchtitan's FullAC checkpoints every block; allowed for --impl "
                f"torchtitan: none, selective, selective_op, full (got every_k {every})",
                field="recompute",
            )
        cfg = config if config is not None else torchtitan.config_for(model, train.seq_len)
        net = torchtitan.build(cfg)
        if train.recompute == "selective_op":
            torchtitan.apply_selective_op_ac(net)
        elif every == 1:
            torchtitan.apply_full_ac(net)
        masks = torchtitan.attention_masks(net, train.micro_batch_size, train.seq_len)
        return net, lambda m, ids: torchtitan.loss(m, ids, masks)
    if impl == "torchtune":
        from headroom.calibration import torchtune

        if every not in (None, 1):
            raise SpecError(
                "recompute: torchtune's recipes checkpoint every layer; allowed for --impl "
                f"torchtune: none, selective, full (got every_k {every})",
                field="recompute",
            )
        net = torchtune.build(model, train.seq_len)
        if every == 1:
            torchtune.apply_full_ac(net)
        return net, torchtune.loss
    if impl == "megatron":
        from headroom.calibration import megatron

        if train.recompute == "selective_op":
            raise SpecError(
                "recompute: selective_op is torchtitan's policy; allowed for --impl megatron: "
                "none, selective (its core attention), full, every_k",
                field="recompute",
            )
        parallel = train.parallel
        net = megatron.build(
            model,
            train.seq_len,
            torch.get_default_dtype(),
            train.recompute == "selective",
            every,
            parallel.tp,
            parallel.sequence_parallel,
        )
        return net, megatron.loss
    if impl != "runtime":
        raise SpecError(f"impl: unknown {impl!r}; allowed: {', '.join(IMPLS)}", field="impl")
    check_supported(model)
    capacity = model.moe.capacity_factor if model.moe and model.moe.capacity_factor else 1.25
    net = DecoderLM(model, train.moe_capacity_factor or capacity)
    return net, lambda m, ids: loss_fn(m(ids, every), ids)


def trace(
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    steps: int = 2,
    impl: str = "runtime",
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Per-bucket bytes of ``steps`` training steps: at the end of each phase and at the peak.

    ``impl`` is ``runtime`` (the trainer's model) or ``hf`` (a transformers model built from
    ``config``, by default the one ``calibration.hf.config_for(model)`` writes)."""
    dtype = check_traceable(train, impl)
    start = time.perf_counter()
    phases: list[dict[str, Any]] = []
    previous = torch.get_default_dtype()
    masks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if impl == "hf":
        from headroom.calibration.hf import causal_masks_as_in_a_real_run

        masks = causal_masks_as_in_a_real_run()
    elif impl == "torchtitan":
        from headroom.calibration.torchtitan import flex_attention_as_on_a_gpu

        masks = flex_attention_as_on_a_gpu(compiled_region=True)
    elif impl == "torchtune":
        from headroom.calibration.torchtune import require_torchtune

        require_torchtune()
    elif impl == "megatron":
        from headroom.calibration import megatron

        megatron.require_megatron()
        megatron.check_model(model)
        masks = contextlib.ExitStack()
        masks.enter_context(megatron.one_rank(train.parallel.tp))
        masks.enter_context(megatron.as_on_a_gpu())
    # both implementations' shapes are independent of the values
    with FakeTensorMode(), gpu_attention_kernels(), masks:
        torch.set_default_dtype(dtype)
        try:
            net, batch_loss = _build(impl, model, train, config)
        finally:
            torch.set_default_dtype(previous)
        optimizer = torch_adamw(net.parameters(), train.optimizer_impl, lr=1e-4)
        tracker = MemTracker()
        tracker.track_external(net, optimizer)

        def snapshot(phase: str, step: int) -> None:
            current = _categories(tracker.get_tracker_snapshot("current"))
            phases.append({"phase": phase, "step": step, **current})

        with tracker:
            for step in range(1, steps + 1):
                for micro in range(train.grad_accum_steps):
                    if step > 1 or micro:
                        tracker.reset_mod_stats()  # per-module stats are per iteration
                    ids = torch.randint(
                        0,
                        model.vocab_size,
                        (train.micro_batch_size, train.seq_len),
                    )
                    loss = batch_loss(net, ids)
                    snapshot("forward", step)
                    torch.autograd.backward(loss / train.grad_accum_steps)
                    del loss
                    snapshot("backward", step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                snapshot("optimizer", step)
            peak = _categories(tracker.get_tracker_snapshot("peak"))
            layers = [
                _categories(snaps[0])
                for layer in decoder_layers(net)
                for snaps in [tracker.memory_tracking[layer].snapshots.get(_ModState.PEAK_BW)]
                if snaps
            ]
    return {
        "impl": impl,
        "mode": "fake",
        "seconds": time.perf_counter() - start,
        "peak": peak,
        "phases": phases,
        "layer_backward_peaks": layers,
        "torch": torch.__version__,
    }


def decoder_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of the runtime's model, a transformers causal LM or torchtitan's
    decoder (a ModuleDict of blocks), in order."""
    for path in ("layers", "model.layers", "decoder.layers"):
        found: Any = net
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return list(found)
        if isinstance(found, torch.nn.ModuleDict):
            return list(found.values())
    raise TypeError(f"no decoder layers found in {type(net).__name__}")


def layer_backward_peak(measured: dict[str, Any]) -> int:
    """The largest total while a decoder layer's backward ran (the last micro-batch's)."""
    return max((p["total"] for p in measured["layer_backward_peaks"]), default=0)


def steady_forward_transient(measured: dict[str, Any]) -> int:
    """Transient bytes at the end of the last step's forward (optimizer state exists then)."""
    forwards = [p for p in measured["phases"] if p["phase"] == "forward"]
    return int(forwards[-1]["transient"])
