"""Trace a training step under FSDP2 on the CPU: torchtitan's default run, on one rank of a fake
process group, under PyTorch's FSDP memory tracker.

The run is torchtitan's (``torchtitan/models/llama3/infra/parallelize.py``): tensor parallelism
first when ``parallel.tp > 1`` (a 2-D ``(dp, tp)`` device mesh; the embedding row-wise with
sequence-sharded output, every norm sequence parallel, attention's Q/K/V and the MLP's gate/up
column-wise, their output projections row-wise back to sequence shards, the head column-wise
with vocabulary-sharded logits and the loss computed under ``loss_parallel``); then, with
``recompute: full``, every decoder layer wrapped in a non-reentrant activation checkpoint; then
``fully_shard`` on every decoder layer and on the root with
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` and ``reshard_after_forward=True`` (the
root's group holds the embedding, final norm and head; torchtitan's current ``apply_fsdp`` gives
the embedding, and the norm with the head, groups of their own). The sharded parameters are
fp32 (``precision.master``), computed in ``precision.params`` (bf16) and reduced in
``precision.grads``. Each step clips the gradients' global norm when
``max_grad_norm`` is set and steps ``torch.optim.AdamW`` (``optimizer_impl``: torchtitan ships
fused) over the sharded DTensor parameters.

The model is a transformers one built from a config with random weights (``calibration.hf``),
or with ``impl="torchtitan"`` torchtitan's own Llama 3 parallelized by torchtitan's own
``parallelize_llama`` (``partial_dtensor`` backend): its FSDP grouping and, with
``parallel.tp > 1``, its own tensor-parallel plan (the sharding configs its trainer sets,
``set_llama3_sharding_config``; its vocabulary-parallel loss).
The process group is ``torch.distributed``'s ``fake`` backend: collectives return at once and
rank 0 holds what any rank holds (FSDP2 pads its shards, rank 0's are the largest). Under fake
tensors (``mode="fake"``, the default) nothing is allocated, so layers of full width trace in
about a second each at any world size; ``mode="real"`` runs real tensors (small models) to
check that both agree.

``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` classifies every live byte:
sharded and unsharded parameters, buffers, sharded and unsharded gradients, activations,
temporaries (backward), all-gather outputs, reduce-scatter inputs, optimizer state (everything
the optimizer step allocates, its temporaries too) and the inputs. The trace keeps, per phase
(each step's forward, backward and optimizer step, named as the planner names its phases), the
categories at that phase's largest total; the peak is the largest of them.

**DTensor's sharding propagation under fake tensors.** To learn an operator's output shape,
DTensor builds fake tensors of the *global* shape of every DTensor argument and runs the
operator on them
(``torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached``),
in ``detect_fake_mode() or FakeTensorMode()``. In a real run no fake mode is active, so this
happens in a fresh mode, which the tracker tells apart from the computation and ignores. Under
a fake tensor trace ``detect_fake_mode()`` finds the trace's own mode, and the tracker counts
the propagation's global-shape tensors as allocations. They show only where DTensor's caches
(a C++ one and a Python one, per operator and argument shapes) have not seen the call yet: the
first optimizer step (and, under tensor parallelism, every forward and backward operator whose
call the caches keep missing). torch's foreach AdamW hands each ``_foreach_*`` operator the
whole list of parameters, gradients and moments, fused AdamW hands ``_fused_adamw_`` all four
lists at once, so the first step seems to hold several unsharded fp32 copies of the whole
model: a two-layer 512-wide llama (40 MiB of fp32 parameters) at world size 4 showed
143 MiB of optimizer state and temporaries in its first step with foreach and 172 MiB with
fused, where a real run holds 29 and 19 MiB (for_loop, one parameter at a time: 45 against
23 MiB); with tensor parallelism every forward also showed 8 MiB more. Which trace saw how
much depended on what the same process had traced before. A real run holds none of it, so the
trace runs DTensor's propagation in a fake mode of its own (:func:`dtensor_propagation_apart`),
as a real run does, and then agrees with a real-tensor trace byte for byte: the optimizer step
holds the sharded moments and, with foreach, ``sqrt(v)`` of every local shard (with for_loop of
one; fused none).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from headroom import planner
from headroom.calibration.comparison import COMPARED
from headroom.calibration.tracing import decoder_layers
from headroom.planner.errors import SpecError

#: tracker category → the key a trace writes
CATEGORIES = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_states",
    "Inputs": "inputs",
}
#: trace key → the bucket of a ``TracePeak`` (the compared buckets of ``calibration.tracing``)
BUCKET_OF = {
    "sharded_params": "params",
    "unsharded_params": "params",
    "buffers": "params",
    "all_gather": "params",
    "sharded_grads": "grads",
    "unsharded_grads": "grads",
    "reduce_scatter": "grads",
    "optimizer_states": "optimizer_states",
    "activations": "transient",
    "temporaries": "transient",
    "inputs": "transient",
}
#: the phases of a trace, in time order (step 1 runs before optimizer state exists)
PHASES = ("step1_forward", "step1_backward", "step1_optimizer", "forward", "backward", "optimizer")
#: the model types whose modules the tensor-parallel plan names
TP_MODEL_TYPES = ("llama", "qwen2")

# torchtitan's DTensor backend for its FSDP2 and tensor-parallel plan (``ParallelismConfig.
# spmd_backend``): its default ``spmd_types`` backend declares the same layouts and groups
SPMD_BACKEND = "partial_dtensor"
#: ``precision.params`` / ``precision.grads`` → torch dtype (FSDP2's param and reduce dtypes)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_traceable(train: planner.TrainSpec) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of a spec an FSDP2 trace runs; else a SpecError naming the
    field and what is allowed."""
    p, par = train.precision, train.parallel
    if p.master != "fp32" or p.optimizer_states != "fp32":
        raise SpecError(
            "precision: an fsdp2 trace keeps fp32 sharded parameters and fp32 AdamW states; set "
            f"master and optimizer_states to fp32 (got {p.model_dump()})",
            field="precision",
        )
    if train.optimizer != "adamw":
        raise SpecError(
            f"optimizer: an fsdp2 trace runs torch AdamW; allowed: adamw (got {train.optimizer})",
            field="optimizer",
        )
    if train.offload.mode != "none":
        raise SpecError(
            "offload.mode: an fsdp2 trace keeps its state on the device; allowed: none "
            f"(got {train.offload.mode})",
            field="offload.mode",
        )
    if train.recompute not in ("none", "full"):
        raise SpecError(
            "recompute: an fsdp2 trace checkpoints every decoder layer or none; allowed: none, "
            f"full (got {train.recompute})",
            field="recompute",
        )
    if train.framework != "fsdp2":
        raise SpecError(
            f"framework: an fsdp2 trace runs the fsdp2 framework; allowed: fsdp2 (got "
            f"{train.framework})",
            field="framework",
        )
    if par.zero_stage != 3:
        raise SpecError(
            "parallel.zero_stage: FSDP2's fully_shard shards parameters, gradients and "
            f"optimizer state; allowed: 3 (got {par.zero_stage})",
            field="parallel.zero_stage",
        )
    for name in ("pp", "cp", "ep"):
        if getattr(par, name) != 1:
            raise SpecError(
                f"parallel.{name}: an fsdp2 trace runs data and tensor parallelism; allowed: 1 "
                f"(got {getattr(par, name)})",
                field=f"parallel.{name}",
            )
    if par.sequence_parallel != (par.tp > 1):
        raise SpecError(
            "parallel.sequence_parallel: torchtitan's tensor parallelism shards the norms' "
            "sequence; allowed: true with tp > 1, false without "
            f"(got {par.sequence_parallel} with tp {par.tp})",
            field="parallel.sequence_parallel",
        )
    return DTYPES[p.params], DTYPES[p.grads]


def check_model(config: dict[str, Any], train: planner.TrainSpec) -> None:
    """A SpecError unless the tensor-parallel plan can shard ``config``'s model."""
    tp = train.parallel.tp
    if tp == 1:
        return
    if config.get("model_type") not in TP_MODEL_TYPES:
        raise SpecError(
            f"model_type: an fsdp2 trace with tp > 1 shards {', '.join(TP_MODEL_TYPES)} models "
            f"(got {config.get('model_type')!r})",
            field="model_type",
        )
    if config.get("tie_word_embeddings"):
        raise SpecError(
            "model.tied_embeddings: the tensor-parallel plan shards the embedding row-wise and "
            "the head column-wise; allowed with tp > 1: false",
            field="model.tied_embeddings",
        )
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = config.get(key) or config["num_attention_heads"]
        if value % tp:
            raise SpecError(f"parallel.tp: {tp} must divide {key} ({value})", field="parallel.tp")
    if train.seq_len % tp:
        raise SpecError(
            f"seq_len: sequence parallelism splits it over tp {tp}; got {train.seq_len}",
            field="seq_len",
        )


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The default process group as rank 0 of ``world_size`` on the ``fake`` backend, for the
    block's duration (refused when a process group exists: this process would lose it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("an fsdp2 trace needs this process's default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def dtensor_propagation_apart() -> Iterator[None]:
    """DTensor's sharding propagation in a fake mode of its own, as in a real run (see the
    module docstring): inside a fake tensor trace it would otherwise reuse the trace's mode and
    the tracker would count its global-shape outputs as allocations."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode  # type: ignore[attr-defined]

    def apart(*args: Any, **kwargs: Any) -> None:
        return None  # ``detect_fake_mode() or FakeTensorMode()``: a fresh mode

    _sharding_prop.detect_fake_mode = apart  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def device_meshes_outside_fake_tensors() -> Iterator[None]:
    """Device meshes built from real rank tensors while fake tensors are on: ``fully_shard``
    joins the data- and tensor-parallel meshes into one (``DeviceMesh._concatenate``), and
    finding this rank's coordinates in a fake rank tensor has no answer (``nonzero``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _redistribution_advice_off() -> Iterator[None]:
    """No warning that the gradient norm's two partial reductions over the 2-D mesh could be
    one over a flattened mesh (a scalar each: no byte of the trace depends on it)."""
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        yield
    finally:
        redistribute.setLevel(level)


class _PhaseTracker(FSDPMemTracker):  # type: ignore[no-untyped-call]
    """``FSDPMemTracker`` that also keeps, per phase, the categories at the phase's largest
    total (``phases``)."""

    def __init__(self, mod: torch.nn.Module, optm: torch.optim.Optimizer) -> None:
        super().__init__(mod, optm)
        self.phases: dict[str, dict[str, int]] = {}
        self._phase_peak: dict[str, int] = {"total": 0}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Keep the largest total of the block in ``phases[name]`` (the largest of the
        block's runs: one per micro-batch)."""
        self._phase_peak = _keys(self.get_tracker_snapshot("current"))
        yield
        if self._phase_peak["total"] > self.phases.get(name, {"total": -1})["total"]:
            self.phases[name] = self._phase_peak

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        current = _keys(self._curr_mem_snap)
        if current["total"] > self._phase_peak["total"]:
            self._phase_peak = current


def _keys(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A tracker snapshot as trace keys summed over devices (zero categories left out)."""
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            name = CATEGORIES.get(str(getattr(category, "value", category)))
            if name is not None and nbytes:
                out[name] = out.get(name, 0) + int(nbytes)
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def buckets(categories: dict[str, int]) -> dict[str, int]:
    """Trace categories summed into the compared buckets (:data:`BUCKET_OF`) and their total."""
    out = dict.fromkeys(COMPARED, 0)
    for name, nbytes in categories.items():
        if name != "total":
            out[BUCKET_OF[name]] += nbytes
    out["total"] = sum(out[b] for b in COMPARED)
    return out


def transient_bytes(categories: dict[str, int]) -> int:
    """The transient bytes of trace categories (activations, temporaries, inputs)."""
    return sum(v for k, v in categories.items() if BUCKET_OF.get(k) == "transient")


def _mesh(train: planner.TrainSpec) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the data-parallel mesh FSDP2 shards over, the tensor-parallel mesh or None)."""
    dp, tp = train.parallel.dp, train.parallel.tp
    if tp == 1:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)), None
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def apply_tp(net: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's tensor-parallel plan (``apply_tp``, loss parallel) on a transformers
    llama/qwen2 causal LM's modules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        net,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for layer in decoder_layers(net):
        parallelize_module(
            layer,
            tp_mesh,
            {
                "input_layernorm": SequenceParallel(),
                # transformers passes the attention its input by keyword
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(
                    output_layouts=Shard(1), use_local_output=False
                ),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        )


def apply_ac(net: torch.nn.Module) -> None:
    """torchtitan's full activation checkpointing: every decoder layer wrapped (non-reentrant,
    no RNG state kept), before ``fully_shard``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = net.get_submodule("model.layers")
    for i, layer in enumerate(decoder_layers(net)):
        layers.register_module(str(i), checkpoint_wrapper(layer, preserve_rng_state=False))


def apply_fsdp(
    net: torch.nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` on every decoder layer and on the root; the layers reshard after
    forward unless ``reshard_after_forward`` is false (FSDP2 never reshards the root then:
    its backward follows at once)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(net):
        fully_shard(
            layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
    fully_shard(net, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)


@contextlib.contextmanager
def _torchtitan_meshes_on_the_cpu() -> Iterator[None]:
    """torchtitan's device meshes on the CPU: with no accelerator found it names ``cuda``
    (``torchtitan.tools.utils.device_type``), which ``ParallelDims.build_mesh`` then asks for;
    the trace's meshes are CPU meshes over the fake process group, as the hf run's are."""
    from torchtitan.distributed import parallel_dims

    original = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims.device_type = original


@contextlib.contextmanager
def _torchtitan_backend(name: str) -> Iterator[None]:
    """torchtitan's SPMD backend set as its trainer sets it (``dist_utils.set_spmd_backend``
    of ``parallelism.spmd_backend``): its loss reads it to take tensor-parallel logits."""
    from torchtitan.distributed import utils as dist_utils

    original = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(name)
    try:
        yield
    finally:
        dist_utils.set_spmd_backend(original)


def _torchtitan_parallelized(
    config: Any,
    train: planner.TrainSpec,
    tensors: contextlib.AbstractContextManager[Any],
) -> tuple[torch.nn.Module, Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]]:
    """torchtitan's Llama 3 of ``config`` parallelized by torchtitan's own
    ``parallelize_llama`` (its FSDP grouping, ``apply_fsdp_to_decoder``; ``FullAC`` with
    ``recompute: full``; ``fsdp_reshard_after_forward`` default or never), and its loss."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from headroom.calibration import torchtitan

    par, precision = train.parallel, train.precision
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=par.dp,
        tensor_parallel_degree=par.tp,
        enable_sequence_parallel=par.sequence_parallel,
        fsdp_reshard_after_forward="default" if train.fsdp2.reshard_after_forward else "never",
        spmd_backend=SPMD_BACKEND,
    )
    dims = ParallelDims.from_config(parallelism, par.dp * par.tp)
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    set_llama3_sharding_config(config, enable_sp=par.sequence_parallel)
    with _torchtitan_meshes_on_the_cpu():
        dims.build_mesh()
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    with tensors:
        net = torchtitan.build(config)
        parallelize_llama(
            net,
            parallel_dims=dims,
            training=TrainingConfig(
                local_batch_size=train.micro_batch_size,
                seq_len=train.seq_len,
                mixed_precision_param=names[precision.params],
                mixed_precision_reduce=names[precision.grads],
            ),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=FullAC.Config() if train.recompute == "full" else None,
            dump_folder="",
        )
    masks = torchtitan.attention_masks(net, train.micro_batch_size, train.seq_len)
    return net, lambda net, ids: torchtitan.loss(net, ids, masks)


def trace(
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    steps: int = 2,
    config: dict[str, Any] | None = None,
    mode: str = "fake",
    impl: str = "hf",
) -> dict[str, Any]:
    """Per-phase bytes of ``steps`` FSDP2 training steps of ``model`` (a transformers model
    built from ``config``, by default ``calibration.hf.config_for(model)``) on rank 0 of
    ``parallel.dp x parallel.tp`` ranks.

    Returns the peak per compared bucket and its ``peak_phase``, each phase's categories at its
    largest total (``phases``), each decoder layer's largest total inside its backward
    (``layer_backward_peaks``, the last step's) and the categories at the end of the last
    forward (``forward_end``)."""
    from headroom.calibration import hf

    if mode not in ("fake", "real"):
        raise SpecError(f"mode: allowed: fake, real (got {mode!r})", field="mode")
    if impl not in ("hf", "torchtitan"):
        raise SpecError(f"impl: allowed: hf, torchtitan (got {impl!r})", field="impl")
    param_dtype, reduce_dtype = check_traceable(train)
    if impl == "torchtitan":
        return _trace_torchtitan(model, train, steps, mode, config)
    cfg = config if config is not None else hf.config_for(model)
    hf.spec_of(cfg)
    check_model(cfg, train)
    par = train.parallel
    start = time.perf_counter()
    tensors: contextlib.AbstractContextManager[Any] = (
        FakeTensorMode() if mode == "fake" else contextlib.nullcontext()
    )
    with (
        fake_process_group(par.dp * par.tp),
        dtensor_propagation_apart(),
        device_meshes_outside_fake_tensors(),
        _redistribution_advice_off(),
        hf.causal_masks_as_in_a_real_run(),
    ):
        dp_mesh, tp_mesh = _mesh(train)
        with tensors:
            net = hf.build(cfg)  # fp32, the sharded parameters' dtype
            if tp_mesh is not None:
                apply_tp(net, tp_mesh)
            if train.recompute == "full":
                apply_ac(net)
            apply_fsdp(net, dp_mesh, param_dtype, reduce_dtype, train.fsdp2.reshard_after_forward)
            optimizer = _torchtitan_adamw(net, train)
            measured = _steps(net, optimizer, model, train, steps, tp_mesh is not None)
    return {
        "impl": "hf",
        "framework": "fsdp2",
        "mode": mode,
        "seconds": time.perf_counter() - start,
        **measured,
        "torch": torch.__version__,
    }


def _trace_torchtitan(
    model: planner.ModelSpec, train: planner.TrainSpec, steps: int, mode: str, config: Any
) -> dict[str, Any]:
    """:func:`trace` of torchtitan's own Llama 3, parallelized by torchtitan's own code (see
    :func:`_torchtitan_parallelized`; torchtitan's ``partial_dtensor`` backend, whose FSDP
    grouping its default ``spmd_types`` backend shares)."""
    from headroom.calibration import torchtitan

    if train.parallel.tp > 1 and model.tied_embeddings:
        # its TP plan distributes the embedding's and the head's weight each on its own
        # (``Module._distribute_states``), so the tie is broken until its trainer ties them
        # again after FSDP2 has made both groups' shards (``Decoder.init_states``)
        raise SpecError(
            "model.tied_embeddings: torchtitan's tensor-parallel plan breaks a tied table in "
            "two; an fsdp2 trace of torchtitan's model with parallel.tp > 1 allows: false",
            field="model.tied_embeddings",
        )
    # Llama 3's shape (or a SpecError naming the field it lacks), RoPE as long as the sequence
    cfg = config if config is not None else torchtitan.config_for(model, train.seq_len)
    start = time.perf_counter()
    tensors: contextlib.AbstractContextManager[Any] = (
        FakeTensorMode() if mode == "fake" else contextlib.nullcontext()
    )
    with (
        fake_process_group(train.parallel.dp * train.parallel.tp),
        dtensor_propagation_apart(),
        device_meshes_outside_fake_tensors(),
        _redistribution_advice_off(),
        torchtitan.flex_attention_as_on_a_gpu(),
        _torchtitan_backend(SPMD_BACKEND),
    ):
        net, batch_loss = _torchtitan_parallelized(cfg, train, tensors)
        with tensors:
            optimizer = _torchtitan_adamw(net, train)
            measured = _steps(net, optimizer, model, train, steps, False, batch_loss)
    return {
        "impl": "torchtitan",
        "framework": "fsdp2",
        "mode": mode,
        "seconds": time.perf_counter() - start,
        **measured,
        "torch": torch.__version__,
    }


def _torchtitan_adamw(net: torch.nn.Module, train: planner.TrainSpec) -> torch.optim.Optimizer:
    """torch AdamW with torchtitan's hyperparameters (no byte depends on them) and the spec's
    ``optimizer_impl``."""
    return torch.optim.AdamW(
        net.parameters(),
        lr=8e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        foreach=train.optimizer_impl == "foreach",
        fused=train.optimizer_impl == "fused",
    )


def _hf_loss(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = net(input_ids=ids, labels=ids).loss
    return loss


def _steps(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model: planner.ModelSpec,
    train: planner.TrainSpec,
    steps: int,
    loss_parallel: bool,
    batch_loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _hf_loss,
) -> dict[str, Any]:
    """Run and track ``steps`` training steps (see :func:`trace`)."""
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    losses: Callable[[], contextlib.AbstractContextManager[Any]] = (
        loss_parallel_context if loss_parallel else contextlib.nullcontext
    )
    tracker = _PhaseTracker(net, optimizer)
    forward_end: dict[str, int] = {}
    first = True
    with tracker:
        for step in range(1, steps + 1):
            prefix = "step1_" if step == 1 else ""
            for _ in range(train.grad_accum_steps):
                if not first:
                    tracker.reset_mod_stats()  # per-module stats are per iteration
                first = False
                ids = torch.randint(0, model.vocab_size, (train.micro_batch_size, train.seq_len))
                tracker.track_inputs((ids,))
                with losses():  # the loss's backward runs under it too
                    with tracker.phase(f"{prefix}forward"):
                        loss = batch_loss(net, ids)
                    forward_end = _keys(tracker.get_tracker_snapshot("current"))
                    with tracker.phase(f"{prefix}backward"):
                        torch.autograd.backward(loss / train.grad_accum_steps)
                        del loss
            with tracker.phase(f"{prefix}optimizer"):
                if train.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(
                        net.parameters(), train.max_grad_norm, foreach=True
                    )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        layers = [
            _keys(snaps[-1])
            for layer in decoder_layers(net)
            for snaps in [tracker.memory_tracking[layer].snapshots.get(_FSDPModState.PEAK_BW)]
            if snaps
        ]
    phases = tracker.phases
    peak_phase = max(phases, key=lambda name: phases[name]["total"])
    return {
        "peak": buckets(phases[peak_phase]),
        "peak_phase": peak_phase,
        "phases": {name: phases[name] for name in PHASES if name in phases},
        "layer_backward_peaks": layers,
        "forward_end": forward_end,
    }
