"""Why each bucket has the size it has: formula, inputs and source, at the peak phase.

The bytes are the estimate's own: the peak stage's named terms, through the same phase
arithmetic (``planner.phases``), in the peak phase. The formulas document how the terms are
made; the inputs are the terms and knobs they were made from.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from headroom.planner.activations import layer_shape, recomputed
from headroom.planner.buckets import allocator_overhead_bytes
from headroom.planner.budget import GPU_BUCKETS, PHASES, ROW_BUCKETS
from headroom.planner.coefficients import Coefficients, default_coefficients
from headroom.planner.estimator import (
    activation_inputs,
    evaluate,
    knobs,
    overheads,
    stage_terms_from_knobs,
)
from headroom.planner.hardware import Hardware
from headroom.planner.model import ModelSpec
from headroom.planner.train import TrainSpec

_FOUNDATIONS = (
    "Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter "
    "Models (arXiv:1910.02054), section 3.1"
)
_KORTHIKANTI = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
    "(arXiv:2205.05198), section 4"
)
_MEGATRAIN = (
    "Yuan et al. 2026, MegaTrain: Full Precision Training of 100B+ Parameter Large Language "
    "Models on a Single GPU (arXiv:2604.05091)"
)
_DEEPSPEED = (
    "deepspeed: deepspeed/runtime/zero/stage_1_and_2.py (DeepSpeedZeroOptimizer), stage3.py "
    "(DeepSpeedZeroOptimizer_Stage3), partitioned_param_coordinator.py; held against "
    "estimate_zero2/zero3_model_states_mem_needs (tests/planner/test_deepspeed.py)"
)
_MEGATRON = (
    "megatron: megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py, "
    "megatron/core/optimizer/distrib_optimizer.py; held against megatron/training/"
    "theoretical_memory_usage.py (tests/planner/test_megatron.py)"
)
_FSDP2 = (
    "fsdp2: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py (unshard, post_backward), "
    "_fsdp_collectives.py (foreach_all_gather, foreach_reduce); torchtitan/distributed/fsdp.py "
    "(apply_fsdp_to_decoder: groups split); traced in calibration/data/hf-fsdp2-traces.json "
    "and torchtitan-fsdp2-traces.json"
)


class Explanation(BaseModel):
    """How one bucket was computed."""

    model_config = ConfigDict(frozen=True)

    bucket: str
    bytes: int
    formula: str
    inputs: dict[str, int | float | str | None]
    source: str


def explain(
    model: ModelSpec, train: TrainSpec, hardware: Hardware, coefficients: Coefficients | None = None
) -> dict[str, Explanation]:
    """Explain every GPU bucket of the estimate (values at the peak phase)."""
    settings = knobs(train)
    coeffs = coefficients or default_coefficients(settings.activation_profile, hardware.name)
    verdict = evaluate(model, settings, hardware, coeffs)
    t = stage_terms_from_knobs(model, settings, coeffs, verdict.stage)
    row = t.rows()[PHASES.index(verdict.peak_phase)]
    over = overheads(coeffs, hardware, settings.expandable_segments)
    bytes_of = dict(zip(ROW_BUCKETS, row, strict=True))
    bytes_of["cuda_context"] = over.cuda_context_bytes
    bytes_of["allocator_overhead"] = allocator_overhead_bytes(
        sum(row), over.allocator_overhead_fraction
    )
    prec = train.precision
    sp, a, states = t.stage_params, t.activations.layer, t.states
    common = {"stage": verdict.stage, "peak_phase": verdict.peak_phase}
    local = {"local_dense_params": sp.dense_numel, "local_expert_params": sp.expert_numel}
    zero = {
        "zero_stage": settings.zero_stage,
        "zero_shards_dense": tuple(states.zero_dense),
        "zero_shards_expert": tuple(states.zero_expert),
    }
    rows: dict[str, tuple[str, dict[str, object], str]] = {}
    if t.streaming:
        rows["params"] = (
            "num_buffers x largest_unit_params x bytes(params)",
            {
                "num_buffers": settings.num_buffers,
                "largest_unit_params": sp.max_unit_numel,
                "bytes_params": settings.param_bytes,
            },
            _MEGATRAIN + " (double-buffered layer streaming)",
        )
        rows["grads"] = (
            "largest_unit_params x bytes(grads): the unit in backward",
            {"largest_unit_params": sp.max_unit_numel},
            "runtime/trainer.py (the streaming trainer: one unit's gradients on the GPU at a time)",
        )
        rows["transfer_buffers"] = (
            "2 gradient slabs x largest_unit_params x bytes(grads)",
            {"largest_unit_params": sp.max_unit_numel},
            _MEGATRAIN,
        )
    elif settings.framework == "fsdp2":
        fsdp2: dict[str, object] = {
            **local,
            "dp_shards": settings.dp * settings.cp,
            "root_params": (sp.embedding_numel if sp.has_embedding else 0)
            + (sp.head_unit_numel if sp.has_head else 0),
            "block_params": sp.max_unit_numel,
            "reshard_after_forward": settings.reshard_after_forward,
            "groups": settings.fsdp2_groups,
            "param_dtype": prec.params,
            "reduce_dtype": prec.grads,
        }
        rows["params"] = (
            "fsdp2: local_params / dp_shards x bytes(master): the fp32 sharded parameters, "
            "no separate master copy",
            {**fsdp2, "precision": prec.master},
            _FSDP2,
        )
        rows["grads"] = (
            "fsdp2: sharded gradients of the blocks whose post-backward is done x bytes(master); "
            "the running block's unsharded in param_dtype (backward_mlp_grads x its MLP's at "
            "the MLP's peak); the head's unsharded until the root's post-backward",
            {**fsdp2, "backward_mlp_grads": coeffs.backward_mlp_grads},
            _FSDP2,
        )
        if settings.fsdp2_groups == "split":
            transfer = (
                "fsdp2 (groups split, torchtitan's apply_fsdp_to_decoder): the block running "
                "+ the block prefetched (under the bottom: the embedding) + the block above's "
                "reduce-scatter input (reduce_dtype); forward and loss: the head's group "
                "gathered; after the loss: the head's group, a group-sized all-gather output "
                "and its reduce-scatter input; the end: the embedding gathered and its "
                "gradient, or its reduce-scatter input; reshard_after_forward false: the "
                "embedding and every block gathered until their backward is done"
            )
        else:
            transfer = (
                "fsdp2: root gathered (param_dtype) + the block running + the block prefetched "
                "(none under the bottom) + the block above's reduce-scatter input (reduce_dtype; "
                "none above the top); forward: root + the last all-gather's block; "
                "reshard_after_forward false: every block gathered until its backward is done"
            )
        rows["transfer_buffers"] = (transfer, fsdp2, _FSDP2)
    elif settings.framework == "megatron":
        mc: dict[str, object] = {
            **local,
            **zero,
            "use_distributed_optimizer": settings.distributed_optimizer,
            "main_grads": prec.grads,
        }
        rows["params"] = (
            "megatron: local_params x bytes(params), whole on every data-parallel rank",
            mc,
            _MEGATRON,
        )
        rows["grads"] = (
            "megatron: the contiguous main-gradient buffer, local_params x bytes(grads), "
            "resident in every phase (its buckets are views of it)",
            mc,
            _MEGATRON,
        )
        rows["transfer_buffers"] = (
            "megatron: 0 (buckets reduce and gather in place)",
            mc,
            _MEGATRON,
        )
    elif settings.framework == "deepspeed":
        reduce_bucket, buckets, prefetch, max_live, threshold, sub_group = settings.deepspeed
        ds: dict[str, object] = {
            **local,
            **zero,
            "precision": prec.params,
            "reduce_bucket_size": reduce_bucket,
            "reduce_buckets": buckets,
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_live_parameters": max_live,
            "stage3_param_persistence_threshold": threshold,
            "sub_group_size": sub_group,
        }
        rows["params"] = (
            "deepspeed: local_params x bytes(params); stage 3: a 1/N partition, tensors up to "
            "stage3_param_persistence_threshold whole",
            ds,
            _DEEPSPEED,
        )
        rows["grads"] = (
            "deepspeed: stage 1 every gradient; stage 2-3 the rank's 16-bit partition (the "
            "offloaded share's on the host); the running layer's whole while its backward "
            "makes them",
            ds,
            _DEEPSPEED,
        )
        rows["transfer_buffers"] = (
            "deepspeed: reduce_bucket_size x reduce_buckets (2 with overlap_comm) in backward; "
            "stage 3: min(local_params, max(largest layer, stage3_max_live_parameters)) + "
            "stage3_prefetch_bucket_size gathered, x bytes(params)",
            ds,
            _DEEPSPEED,
        )
    else:
        rows["params"] = (
            "local_params / zero3_shards x bytes(params)",
            {**local, **zero, "precision": prec.params},
            _FOUNDATIONS,
        )
        rows["grads"] = (
            "local_params / zero2_shards x bytes(grads); unless gradients accumulate, at "
            "layer j's backward those of the head and the layers above j, plus "
            "backward_mlp_grads x j's MLP (experts) gradients",
            {
                **local,
                **zero,
                "precision": prec.grads,
                "backward_mlp_grads": coeffs.backward_mlp_grads,
            },
            _FOUNDATIONS,
        )
        rows["transfer_buffers"] = (
            "ZeRO-3: 2 gathered units x bytes(params); else 0",
            {"largest_unit_params": sp.max_unit_numel, **zero},
            "PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): one unit's all-gather prefetched "
            "while the previous one computes",
        )
    opt_inputs: dict[str, object] = {
        "optimizer": train.optimizer,
        "impl": train.optimizer_impl,
        "gpu_updated_params": states.gpu_updated_numel,
        "offloaded_params": states.offloaded_numel,
        "precision": prec.optimizer_states,
        "temporaries": states.optimizer_temporaries,
    }
    rows["master_params"] = (
        "gpu_updated_params x bytes(master)",
        {"gpu_updated_params": states.gpu_updated_numel, "precision": prec.master, **zero},
        _FOUNDATIONS,
    )
    rows["optimizer_states"] = (
        "moments of gpu_updated_params (adam: 2 x bytes(state)); + step temporaries in the "
        "optimizer phase",
        opt_inputs,
        "Megatron-LM megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py "
        "(HybridDeviceOptimizer, optimizer_offload_fraction f): GPU = P + G + O x (1 - f)",
    )
    rows["ema"] = (
        "4 x local_params / zero1_shards when ema=gpu",
        {"ema": train.ema, **zero},
        "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), section 3.2.3: "
        "the EMA kept in CPU memory",
    )
    gathered = (
        "; fsdp2 with tensor parallelism: the attention's, MLP's and head's inputs saved "
        "gathered over the sequence (DTensor), loss parallelism's fp32 tensor per logit"
        if settings.framework == "fsdp2" and settings.tp > 1
        else ""
    )
    act_inputs = activation_inputs(settings)
    # what each layer below a re-run one keeps: its checkpoint (selective_op: what the policy
    # saved)
    checkpoint = recomputed(layer_shape(model, coeffs, act_inputs), act_inputs)[4]
    per_op = (
        "; selective_op (torchtitan's per-op policy): each layer keeps its input and the "
        "outputs of the ops the policy saves (checkpoint_bytes: its odd-numbered matmuls, "
        "attention's outputs), and the running layer is re-run in its backward"
        if settings.selective_op
        else ""
    )
    rows["activations"] = (
        "in_flight x saved_per_micro_batch (+ one recomputed block in backward); per layer "
        "s·b·h·(34 + 5·a·s/h) for a GPT layer, generalised to GQA/MLA/QK-norm/SwiGLU/MoE"
        + gathered
        + per_op,
        {
            "in_flight_micro_batches": t.in_flight,
            "layers": sp.num_layers,
            "moe_layers": sp.num_moe_layers,
            "dense_layer_bytes": a.dense,
            "moe_layer_bytes": a.moe,
            "attention_scores_bytes": a.scores,
            "checkpoint_every": t.checkpoint_every,
            "checkpoint_bytes": checkpoint,
            "recompute": str(train.recompute),
            "attention": train.attention,
            "profile": coeffs.profile,
        },
        _KORTHIKANTI,
    )
    loss = train.loss
    if loss.priced_impl == "standard":
        rows["logits"] = (
            "tokens x vocab/tp x bytes_per_element (forward) (+ loss backward)",
            {
                "vocab_size": model.vocab_size,
                "bytes_per_element": coeffs.logits_bytes_per_element,
                "backward_bytes_per_element": coeffs.logits_backward_bytes_per_element,
                "loss_impl": loss.impl,
            },
            "coefficients." + coeffs.profile,
        )
    else:
        rows["logits"] = (
            "held from the loss's forward into its backward (forward), + the loss's largest "
            f"moment beyond them (loss backward), derived from the {loss.priced_impl} loss's "
            "source",
            {
                "vocab_size": model.vocab_size,
                "loss_impl": loss.impl,
                "loss_compiled": loss.compiled,
                "loss_chunks": loss.num_chunks or None,
                "held_bytes": t.activations.logits_forward,
                "beyond_bytes": t.activations.logits_backward,
            },
            "planner/losses.py",
        )
    rows["moe_dispatch"] = (
        "per MoE layer: B·T·E·4 + 2·local_experts·C·D·bpe, C = ceil(CF·B·T·top_k/E)",
        {
            "per_layer_bytes": a.dispatch,
            "moe_layers": sp.num_moe_layers,
            "capacity_factor": train.moe_capacity_factor,
            "imbalance": train.moe_imbalance,
        },
        "GShard (Lepikhin et al. 2020, arXiv:2006.16668) capacity C = CF x tokens x top_k / "
        "E; the dispatch and combine buffers of Megatron-Core's token dispatcher",
    )
    rows["cuda_context"] = (
        "constant",
        {"bytes": over.cuda_context_bytes, "calibrated": coeffs.calibrated},
        "coefficients.<profile> (calibrated) or planner/data/gpus/<preset>.json (uncalibrated)",
    )
    rows["allocator_overhead"] = (
        "fraction x allocated at the peak phase",
        {
            "fraction": over.allocator_overhead_fraction,
            "expandable_segments": settings.expandable_segments,
        },
        "PyTorch, CUDA semantics: memory management (the caching allocator's reserved over "
        "allocated; expandable_segments)",
    )
    out = {}
    for bucket in GPU_BUCKETS:
        formula, inputs, source = rows[bucket]
        clean = {
            k: (v if isinstance(v, int | float | str) or v is None else str(v))
            for k, v in {**common, **inputs}.items()
        }
        out[bucket] = Explanation(
            bucket=bucket, bytes=bytes_of[bucket], formula=formula, inputs=clean, source=source
        )
    return out
