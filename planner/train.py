"""The training spec: batch shape, precision, optimizer, recompute, parallelism and placement.

Key names are a contract shared by the CLI (``--train FILE``), the REST API and the runtime.
Defaults are the common case: bf16 params and grads, fp32 master and moments, fused AdamW,
flash attention, no recompute, no offload, every parallel degree 1, ZeRO 0.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, model_validator
from pydantic.config import JsonDict, JsonValue

from headroom.planner._keys import FewUnknownKeys
from headroom.planner._numbers import INTEGER, NUMBER, Float, Int
from headroom.planner.coefficients import profiles
from headroom.planner.losses import (
    CHUNKED_IMPLS,
    COMPILED_IMPLS,
    DEFAULT_LOSS_CHUNKS,
    LossImpl,
)
from headroom.planner.schedules import V_SHAPED, PipelineSchedule

PrecisionName = Literal["fp32", "bf16", "fp16", "none"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd_momentum", "muon", "adafactor", "adamw_8bit"]

#: bytes per element of each precision name
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "none": 0}


#: upper bounds that keep every estimate finite and fast (the estimator walks every stage)
_MAX_DEGREE = 2**20
_MAX_STAGES = 4096
_MAX_FACTOR = 10_000.0
#: batch-shape bounds (the ladder keeps its candidates inside them too)
MAX_MICRO_BATCH = 2**20
MAX_GRAD_ACCUM = 2**30


class _Frozen(FewUnknownKeys):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Precision(_Frozen):
    """Storage precision of each model-state tensor (``none``: not kept)."""

    params: Literal["fp32", "bf16", "fp16"] = "bf16"
    grads: Literal["fp32", "bf16", "fp16"] = "bf16"
    master: PrecisionName = "fp32"
    optimizer_states: Literal["fp32", "bf16", "fp16"] = "fp32"


class Recompute(_Frozen):
    """Block-wise recompute: keep a checkpoint every ``every_k`` layers."""

    every_k: Int = Field(ge=1, le=_MAX_STAGES, description="Layers per recomputed block.")


#: what a run recomputes (``TrainSpec.recompute`` says what each policy is)
RecomputePolicy = Literal["none", "selective", "selective_op", "full"] | Recompute


class Parallel(_Frozen):
    """Parallel degrees; the heaviest rank is reported."""

    dp: Int = Field(default=1, ge=1, le=_MAX_DEGREE, description="Data-parallel replicas.")
    tp: Int = Field(default=1, ge=1, le=_MAX_DEGREE, description="Tensor-parallel degree.")
    pp: Int = Field(default=1, ge=1, le=_MAX_STAGES, description="Pipeline stages.")
    ep: Int = Field(
        default=1, ge=1, le=_MAX_DEGREE, description="Expert-parallel degree (carved from dp x cp)."
    )
    cp: Int = Field(
        default=1, ge=1, le=_MAX_DEGREE, description="Context-parallel degree (sequence split)."
    )
    sequence_parallel: StrictBool = Field(
        default=False, description="Megatron sequence parallelism."
    )
    zero_stage: Int = Field(default=0, ge=0, le=3, description="ZeRO stage over dp x cp.")
    vpp: Int = Field(
        default=1,
        ge=1,
        le=_MAX_STAGES,
        description="Virtual pipeline stages per rank: 1 is the 1F1B schedule, more is "
        "Megatron's interleaved 1F1B (virtual_pipeline_model_parallel_size); needs pp > 1 and "
        "num_layers divisible by pp x vpp.",
    )
    pp_schedule: PipelineSchedule | None = Field(
        default=None,
        description="The pipeline schedule, by torch.distributed.pipelining's name "
        "(torchtitan's parallelism.pipeline_parallel_schedule): 1F1B and GPipe run one stage "
        "per rank (vpp 1); Interleaved1F1B, LoopedBFS and InterleavedZeroBubble run vpp; "
        "ZBVZeroBubble and DualPipeV two in a V (vpp 2, its default with them), the first "
        "rank holding the embedding and the head. Megatron-Core runs "
        "1F1B and Interleaved1F1B, DeepSpeed 1F1B. Default: 1F1B, or Megatron-Core's "
        "interleaved 1F1B where vpp > 1. Sets the micro-batches each stage holds in flight "
        "and the pipeline's bubble (planner/schedules.py).",
    )

    @model_validator(mode="before")
    @classmethod
    def _v_chunks(cls, data: Any) -> Any:
        """A V schedule runs two model chunks per rank of a pipeline: ``vpp`` 2 unless given."""
        if (
            isinstance(data, dict)
            and data.get("pp_schedule") in V_SHAPED
            and "vpp" not in data
            and isinstance(data.get("pp"), int)
            and data["pp"] > 1
        ):
            return {**data, "vpp": 2}
        return data

    @model_validator(mode="after")
    def _check(self) -> Parallel:
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"parallel.vpp: the interleaved schedule needs parallel.pp > 1; allowed with "
                f"pp=1: 1, got {self.vpp}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"parallel.ep must divide parallel.dp x parallel.cp ({self.dp * self.cp}), "
                f"got {self.ep}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class Offload(_Frozen):
    """Where persistent state lives: all on the GPU, part of the optimizer on the host, or all
    of it on the host with layers streamed through the GPU."""

    mode: Literal["none", "optimizer", "streaming"] = "none"
    fraction: Float = Field(
        default=1.0, ge=0.0, le=1.0, description="Optimizer mode: share of parameters offloaded."
    )
    checkpoint_every: Annotated[int, Field(ge=1, le=_MAX_STAGES), INTEGER] | None = Field(
        default=None,
        description="Streaming mode: layers per checkpointed block (default 1).",
    )
    num_buffers: Int = Field(
        default=2, ge=2, le=1024, description="Streaming mode: device weight buffers."
    )


class Fsdp2(_Frozen):
    """FSDP2's knobs, spelled as ``torch.distributed.fsdp.fully_shard`` spells them.

    ``param_dtype`` and ``reduce_dtype`` of its ``MixedPrecisionPolicy`` are
    ``precision.params`` and ``precision.grads``; the sharded parameters are
    ``precision.master`` (fp32 in torchtitan's run)."""

    reshard_after_forward: StrictBool = Field(
        default=True,
        description="Free each block's gathered parameters after its forward and gather them "
        "again for its backward (torchtitan's default); false keeps every block gathered "
        "from its forward to its backward.",
    )
    groups: Literal["root", "split"] = Field(
        default="root",
        description="How the embedding, final norm and head are grouped: root (one group with "
        "the root, gathered from the first forward to the end of backward, as torchtitan "
        "grouped them up to 0.2) or split (torchtitan 0.3's apply_fsdp_to_decoder: the "
        "embedding a group of its own, resharded after forward; the final norm with the head "
        "one group, kept gathered from its forward through its backward and reduced as soon "
        "as the loss's backward is done; a tied table's three stay one group, as root).",
    )


class DeepSpeed(_Frozen):
    """DeepSpeed ZeRO's knobs, spelled as its ``zero_optimization`` config spells them (in
    elements, DeepSpeed's defaults). The stage is ``parallel.zero_stage`` (1-3); CPU offload of
    the optimizer (``offload_optimizer: {device: cpu, ratio}``) is ``offload: {mode: optimizer,
    fraction}``."""

    reduce_bucket_size: Int = Field(
        default=500_000_000, ge=1, le=2**40, description="Elements per gradient reduction bucket."
    )
    overlap_comm: StrictBool | None = Field(
        default=None,
        description="Overlap reduction with backward (two reduction buckets); default: "
        "DeepSpeed's (true at stage 3, false below).",
    )
    stage3_prefetch_bucket_size: Int = Field(
        default=50_000_000, ge=0, le=2**40, description="Stage 3: elements gathered ahead."
    )
    stage3_max_live_parameters: Int = Field(
        default=1_000_000_000,
        ge=0,
        le=2**40,
        description="Stage 3: gathered elements kept alive before released.",
    )
    stage3_param_persistence_threshold: Int = Field(
        default=100_000,
        ge=0,
        le=2**40,
        description="Stage 3: tensors this small or smaller stay whole on every rank.",
    )
    sub_group_size: Int = Field(
        default=1_000_000_000,
        ge=1,
        le=2**40,
        description="Stage 3: elements of the partition the optimizer steps at a time (its fp32 "
        "gradients and the step's temporaries are one sub-group's).",
    )


class Megatron(_Frozen):
    """Megatron-Core's knobs, spelled as its ``DistributedDataParallelConfig`` and
    ``OptimizerConfig`` spell them. The main gradients' dtype is ``precision.grads`` (fp32:
    ``accumulate_allreduce_grads_in_fp32``, what Megatron-LM sets for bf16); CPU offload of the
    optimizer (``optimizer_cpu_offload``, ``optimizer_offload_fraction``) is ``offload: {mode:
    optimizer, fraction}``."""

    use_distributed_optimizer: StrictBool = Field(
        default=True,
        description="Shard the fp32 master weights and moments over the data-parallel ranks.",
    )
    overlap_grad_reduce: StrictBool = Field(
        default=True, description="Reduce gradient buckets as backward makes them."
    )
    overlap_param_gather: StrictBool = Field(
        default=True, description="Gather updated parameters during the next forward."
    )


class Loss(_Frozen):
    """How the loss is computed from the head's output: the implementation a stack runs, which
    decides how much of the logits exists at once (``planner.losses`` derives each one's
    bytes from its source)."""

    impl: LossImpl = Field(
        default="standard",
        description="standard: the profile's own loss over the whole logits, as its traces "
        "ran it (transformers' ForCausalLMLoss and torchtune's CrossEntropyLoss upcast all "
        "the logits; torchtitan's cross_entropy_loss; Megatron's unfused "
        "vocab_parallel_cross_entropy; Headroom's trainer). chunked: torchtune's "
        "CEWithChunkedOutputLoss (its configs' default; loss._component_ "
        "torchtune.modules.loss.CEWithChunkedOutputLoss, num_output_chunks: loss.chunks): the "
        "model returns every chunk's logits, the loss upcasts one chunk at a time. "
        "chunked_linear: torchtitan 0.3's ChunkedLossWrapper (the default of its Llama 3 "
        "8B/70B/405B configs, num_chunks: loss.chunks): the head and the loss run a chunk at a "
        "time, each chunk's backward inside the loss. fused: Megatron's "
        "--cross-entropy-loss-fusion (cross_entropy_fusion_impl native, compiled; ms-swift's "
        "--cross_entropy_loss_fusion true). fused_linear: Liger Kernel's fused linear cross "
        "entropy (LigerFusedLinearCrossEntropyLoss; transformers' use_liger_kernel, "
        "apply_liger_kernel_to_*(fused_linear_cross_entropy=True)): head and loss fused in "
        "chunks, the gradients made in the forward. cut: Apple's Cut Cross-Entropy "
        "(cut_cross_entropy.linear_cross_entropy, its cce_patch; axolotl's "
        "cut_cross_entropy, ms-swift's --use_cce): blockwise, no logits held. chunked, "
        "chunked_linear, fused_linear and cut run on a whole vocabulary (parallel.tp 1).",
    )
    chunks: Annotated[int, Field(ge=1, le=4096), INTEGER] | None = Field(
        default=None,
        description="Chunks of the sequence for chunked and chunked_linear (torchtune's "
        "num_output_chunks, torchtitan's num_chunks); default 8. chunked_linear needs it to "
        "divide the rank's sequence.",
    )

    compiled: StrictBool = Field(
        default=False,
        description="The loss runs under torch.compile: torchtitan's training.compile (which "
        "compiles its cross_entropy_loss since April 2025) with standard, torchtune's "
        "compile: true (which compiles CEWithChunkedOutputLoss's compute_cross_entropy) "
        "with chunked. The compiled cross entropy keeps the 16-bit logits, no fp32 copy. "
        "standard or chunked only, on a whole vocabulary (parallel.tp 1).",
    )

    @property
    def priced_impl(self) -> str:
        """The implementation the estimate prices (``planner.losses``): the compiled form of
        ``impl`` when ``compiled``."""
        return COMPILED_IMPLS[self.impl] if self.compiled else self.impl

    @model_validator(mode="after")
    def _check(self) -> Loss:
        if self.compiled and self.impl not in COMPILED_IMPLS:
            raise ValueError(
                f"loss.compiled: priced for {' and '.join(COMPILED_IMPLS)} (torchtitan's and "
                f"torchtune's compiled cross entropy); got impl {self.impl}"
            )
        if self.chunks is not None and self.impl not in CHUNKED_IMPLS:
            raise ValueError(
                f"loss.chunks: only {' and '.join(CHUNKED_IMPLS)} split the tokens into "
                f"chunks; got chunks {self.chunks} with impl {self.impl}"
            )
        return self

    @property
    def num_chunks(self) -> int:
        """Chunks the implementation splits the tokens into (0: it does not chunk by count)."""
        if self.impl not in CHUNKED_IMPLS:
            return 0
        return self.chunks or DEFAULT_LOSS_CHUNKS


#: the training frameworks the estimate models (``none``: plain data parallelism, ZeRO as
#: ``parallel.zero_stage`` says)
FRAMEWORKS = ("none", "fsdp2", "deepspeed", "megatron")


def _shipped_profiles(schema: JsonDict) -> None:
    """The JSON schema names the profiles with shipped coefficients (the estimate checks it)."""
    schema["enum"] = list[JsonValue](profiles())


class TrainSpec(_Frozen):
    """One training configuration."""

    micro_batch_size: Int = Field(default=1, ge=1, le=MAX_MICRO_BATCH)
    seq_len: Int = Field(default=4096, ge=1, le=2**30)
    grad_accum_steps: Int = Field(default=1, ge=1, le=MAX_GRAD_ACCUM)
    precision: Precision = Precision()
    optimizer: OptimizerName = "adamw"
    optimizer_impl: Literal["foreach", "fused", "for_loop"] = Field(
        default="fused",
        description="Optimizer kernel: fused/multi-tensor (Megatron, DeepSpeed; the default), "
        "foreach (PyTorch's default on CUDA: whole-group temporaries) or for_loop.",
    )
    recompute: RecomputePolicy = Field(
        default="none",
        description="none; selective (the attention core recomputed: Korthikanti et al.); "
        "selective_op (torchtitan's per-op selective checkpointing, SelectiveAC: its "
        "activation_checkpoint mode 'selective' with selective_ac_option 'op', torchtitan "
        "0.3's activation_checkpoint 'selective', the default of its train configs; per block "
        "the outputs of the odd-numbered matmuls, of attention and of the ops in its save "
        "list kept, everything else recomputed in the block's backward; priced by the "
        "torchtitan and textbook profiles, for dense layers); full (every layer "
        'checkpointed); or {"every_k": K} (one checkpoint per K layers).',
    )
    attention: Literal["flash", "eager"] = "flash"
    loss: Loss = Loss()
    activation_profile: str = Field(
        default="textbook",
        min_length=1,
        max_length=64,
        json_schema_extra=_shipped_profiles,
    )
    ema: Literal["none", "gpu", "host"] = "none"
    framework: Literal["none", "fsdp2", "deepspeed", "megatron"] = Field(
        default="none",
        description="Which framework shards and moves the state: none (plain data parallel, "
        "ZeRO as parallel.zero_stage says), fsdp2 (torch's fully_shard on every block and "
        "the root, as torchtitan runs it; needs parallel.zero_stage 3 and offload.mode none) "
        "deepspeed (DeepSpeed ZeRO stage parallel.zero_stage 1-3, its buckets; offload.mode "
        "optimizer is its offload_optimizer) or megatron (Megatron-Core's contiguous gradient "
        "buffer and distributed optimizer; parallel.zero_stage 0).",
    )
    fsdp2: Fsdp2 = Fsdp2()
    deepspeed: DeepSpeed = DeepSpeed()
    megatron: Megatron = Megatron()
    parallel: Parallel = Parallel()
    offload: Offload = Offload()
    moe_capacity_factor: Annotated[float, Field(gt=0, le=_MAX_FACTOR), NUMBER] | None = Field(
        default=None, description="Default: the model's, else 1.25."
    )
    moe_imbalance: Float = Field(
        default=1.0, ge=1.0, le=_MAX_FACTOR, description="Hottest expert load / mean."
    )
    expandable_segments: StrictBool = Field(
        default=False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
    )
    compile: StrictBool = Field(
        default=False,
        description="The decoder layers run under torch.compile (torchtune's compile: true "
        "compiles each TransformerSelfAttentionLayer; its loss is loss.compiled). "
        "AOTAutograd's partitioner recomputes cheap elementwise operations in the backward "
        "rather than saving their outputs, so a compiled layer saves less. Priced for the "
        "profiles whose compiled layer was traced (torchtune), at 16-bit precision, on one "
        "tensor-parallel rank; refused otherwise.",
    )
    optimizer_in_backward: StrictBool = Field(
        default=False,
        description="Step each parameter as its gradient lands and free the gradient "
        "(torchtune's optimizer_in_bwd): no model-wide gradients, no step at the end. One "
        "device, grad_accum_steps 1, max_grad_norm null.",
    )
    max_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False), NUMBER] | None = Field(
        default=1.0,
        description="Global gradient-norm clipping (torch.nn.utils.clip_grad_norm_); null: "
        "none. Streaming with clipping updates after the step's norm is known, overlapping the "
        "next forward; without, each unit is updated as its last gradient lands, overlapping "
        "the backward.",
    )

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def checkpoint_every(self) -> int | None:
        """Layers per recomputed block, or None when activations are not block-checkpointed."""
        every_k = self.recompute.every_k if isinstance(self.recompute, Recompute) else None
        if self.offload.mode == "streaming":
            return self.offload.checkpoint_every or every_k or 1
        return every_k
