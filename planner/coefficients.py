"""Coefficients: the estimator's tunable constants, per activation profile (and device).

The ``textbook`` profile is the literature (Korthikanti et al. 2022 for activations); other
profiles (``runtime`` for Headroom's trainer, ``hf`` for transformers) start from it and are
refitted by calibration. The shipped sets live in ``planner/data/coefficients.json`` with their
provenance; ``calibrated`` says whether measurements stand behind a set.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import ConfigDict, Field

from headroom.planner._keys import FewUnknownKeys
from headroom.planner.errors import SpecError

#: options a profile's traces may never have run (``planner.untraced``), by the field naming
#: them (and, for an architecture's field, the value): eager attention, multi-head latent
#: attention, multi-token prediction layers, context parallelism, 32-bit activations, and the
#: layer shapes of the families ``planner.hf`` reads (MLPs, norms and where they sit, per-head
#: query/key norm weights, soft-capping)
UntracedOption = Literal[
    "attention",
    "model.mla",
    "model.num_mtp_layers",
    "parallel.cp",
    "precision.params",
    "model.ffn_kind=gelu",
    "model.ffn_kind=geglu",
    "model.norm=layernorm",
    "model.norm_params=weight",
    "model.norm_params=weight_and_bias",
    "model.norm_params=none",
    "model.norm_placement=sandwich",
    "model.norm_placement=post",
    "model.norm_placement=parallel",
    "model.qk_norm_weights=per_head",
    "model.attn_logit_softcap",
    "model.final_logit_softcap",
]


#: the margin a verdict adds when no local measurement says otherwise: the largest whole
#: percent at which the published GPU runs' fitted split keeps every verdict, the held-out
#: split too (``python -m headroom.calibration.published --sweep``;
#: ``tests/calibration/test_published_memory.py`` holds it)
DEFAULT_MARGIN_FRACTION = 0.06


class Coefficients(FewUnknownKeys):
    """Multipliers and constants one activation profile applies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str = Field(description="Activation profile these apply to.")
    device: str | None = Field(default=None, description="GPU they were fitted on (None: any).")
    calibrated: bool = Field(default=False, description="Fitted from measurements.")
    source: str = Field(default="textbook", description="Provenance.")
    num_records: int = Field(default=0, ge=0, description="Measurements behind a fitted set.")
    attention_scale: float = Field(default=1.0, ge=0, description="x attention saved tensors.")
    mlp_scale: float = Field(default=1.0, ge=0, description="x dense-FFN saved tensors.")
    norm_scale: float = Field(default=1.0, ge=0, description="x norm inputs saved.")
    moe_scale: float = Field(default=1.0, ge=0, description="x expert intermediates saved.")
    moe_traced: bool = Field(
        default=True,
        description="The profile's MoE terms come from traces of MoE layers (textbook: derived). "
        "A profile fitted to dense layers only has none, and refuses an MoE model rather than "
        "drop its experts' activations.",
    )
    untraced: tuple[UntracedOption, ...] = Field(
        default=(),
        description="Options none of the profile's traces ran: an estimate that uses one is "
        "priced by the planner's derived terms and flagged in the budget's warnings, naming "
        "the field (planner.untraced).",
    )
    selective_op: bool = Field(
        default=True,
        description="The profile prices recompute: selective_op (torchtitan's per-op selective "
        "checkpointing): traced (torchtitan) or derived from the policy (textbook). A profile "
        "whose traces have none refuses it rather than price it as another policy.",
    )
    compiled_layer_hidden_tensors: float | None = Field(
        default=None,
        description="Hidden-width tensors (of the activation dtype, per token) a decoder layer "
        "under torch.compile saves fewer than the eager one (TrainSpec.compile): traced from "
        "the profile's layer compiled on a CPU; None: compile is not traced and is refused.",
    )
    compiled_layer_ffn_tensors: float | None = Field(
        default=None,
        description="The same in FFN-width tensors (the MLP's elementwise outputs).",
    )
    selective_op_saves_attention_inputs: bool = Field(
        default=False,
        description="Under recompute: selective_op the attention operator the policy saves "
        "also returns its queries, keys and values, so they are kept with its output and "
        "log-sum-exp: torchtitan's compiled FlexAttention (its forward graph returns the "
        "inputs its backward needs); SDPA's flash, cuDNN and memory-efficient kernels return "
        "neither (the textbook's).",
    )
    qk_norm_tensors: float = Field(
        default=1.0,
        ge=0,
        description="Tensors per query/key element that per-head Q/K norms save (Qwen3), x "
        "activation bytes; the textbook counts a norm's input once.",
    )
    swiglu_saved_ffn_tensors: float = Field(
        default=3.0, ge=0, description="FFN-width tensors a SwiGLU MLP saves per token."
    )
    gelu_saved_ffn_tensors: float = Field(
        default=2.0,
        ge=0,
        description="FFN-width tensors a two-matrix (GeLU) MLP saves per token, x mlp_scale as "
        "swiglu_saved_ffn_tensors: the activation's input and its output (the second "
        "projection's input); Korthikanti et al. count both.",
    )
    rope_qk_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Query and key tensors per token that rotary embeddings write and the "
        "attention saves beside the Q/K/V projection's output, x (heads + kv_heads) x head_dim "
        "x activation bytes / tp, within attention_scale. Megatron-Core: 1 (its "
        "apply_rotary_pos_emb returns new queries and keys while the values' view keeps the "
        "fused projection's output alive); 0 where a fitted attention_scale holds them.",
    )
    backward_ffn_tensors: float = Field(
        default=0.0,
        ge=0,
        description="FFN-width tensors per token a layer's backward holds beyond its saved ones "
        "(the gradients of the MLP's intermediates), x activation bytes; the textbook counts "
        "saved tensors only.",
    )
    backward_expert_ffn_tensors: float | None = Field(
        default=None,
        ge=0,
        description="FFN-width tensors per routed slot an MoE layer's routed experts' backward "
        "holds beyond its saved ones (their intermediates' gradients, batched over the "
        "experts), x activation bytes; None: backward_ffn_tensors, as a dense MLP's. Shared "
        "experts are dense MLPs and take backward_ffn_tensors.",
    )
    gelu_backward_ffn_tensors: float | None = Field(
        default=None,
        ge=0,
        description="backward_ffn_tensors for a two-matrix (GeLU) MLP, whose backward makes "
        "one FFN-width gradient fewer than SwiGLU's; None: backward_ffn_tensors. Fitted where "
        "a profile's traces have GeLU MLPs (megatron).",
    )
    backward_hidden_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per token a layer's backward holds beyond its saved "
        "ones (the incoming and outgoing gradients), x activation bytes.",
    )
    sp_gather_buffer_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Whole-sequence hidden-width tensors a tensor-parallel rank holds under "
        "sequence parallelism for its all-gathers, one buffer however many layers, x "
        "activation bytes, counted through a layer's backward: Megatron-Core's global memory "
        "buffer ('mpu'), which every column-parallel linear gathers its input into, in forward "
        "and again in backward (1); 0 where the gathers are counted with the layers.",
    )
    recompute_hidden_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per token a recomputed block's backward holds beyond "
        "a plain layer's (the re-run block's output and the checkpoint's gradient).",
    )
    backward_slot_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per routed slot an MoE layer's backward holds beyond "
        "its saved ones beside its routed experts' FFN-width temporaries.",
    )
    backward_end_slot_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per routed slot an MoE layer's backward holds as its "
        "routed experts' backward ends (the dispatched tokens' gradients from the experts' "
        "first projections), beside all of its MLP's gradients with its saved tensors freed.",
    )
    backward_output_slot_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per routed slot an MoE layer's backward holds as it "
        "starts on the experts' outputs (their gradient, the routing weights' product), with "
        "none of its FFN-width temporaries and of its gradients only its shared experts' yet: "
        "a candidate peak of its own.",
    )
    routing_fp32_bytes_per_element: float = Field(
        default=8.0,
        ge=0,
        description="Bytes per routed slot element an MoE layer's backward holds as it starts, "
        "beyond a 16-bit-routed layer's, when its routing weights are fp32 (DeepSeek-V2/V3): "
        "eager autograd's two fp32 gradients of the weighted products. Counted over at most "
        "routing_product_slab_elements.",
    )
    routing_product_slab_elements: int | None = Field(
        default=None,
        gt=0,
        description="Elements at a time the implementation makes the routing weights' "
        "products' gradients in (Headroom's trainer works in slabs); None: all slots at once.",
    )
    tp_backward_end_hidden_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Whole-sequence hidden-width tensors a dense layer holds as its MLP's "
        "backward ends, beside all of the MLP's gradients, under DTensor's tensor parallelism "
        "(framework: fsdp2 with tp > 1): the output's all-gathered gradient and the "
        "column-wise projections' input gradients as partial sums before their "
        "reduce-scatter. Read off FSDP2 traces with tensor parallelism; 0: none beyond the "
        "one-rank terms.",
    )
    embedding_grad_whole_vocab: bool = Field(
        default=True,
        description="Under tensor parallelism the embedding's backward makes the whole "
        "vocabulary's gradient beside the rank's share of the table (DTensor's sharded "
        "embedding, as torch's RowwiseParallel runs it); false where the model code runs the "
        "embedding on its local shard (torchtitan's local_map, Megatron's "
        "VocabParallelEmbedding). Read by framework: fsdp2.",
    )
    backward_mlp_grads: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of a layer's MLP gradients (dense FFN, or an MoE layer's local "
        "and shared experts) that exist at the peak of its backward, when gradients are made "
        "during backward (the output projection's come first); the textbook counts none.",
    )
    head_hidden_tensors: float = Field(
        default=0.0,
        ge=0,
        description="Hidden-width tensors per token kept outside the layers (final norm, "
        "embedding output), x activation bytes; the textbook counts layers only.",
    )
    logits_bytes_per_element: float = Field(
        default=6.0, ge=0, description="Forward: 16-bit logits + fp32 log-probs kept by the loss."
    )
    logits_backward_bytes_per_element: float = Field(
        default=6.0, ge=0, description="Loss backward: fp32 grad of logits + its 16-bit cast."
    )
    allocator_overhead_fraction: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Reserved minus allocated over allocated (None: GPU default).",
    )
    expandable_segments_overhead_fraction: float = Field(
        default=0.02, ge=0, lt=1, description="The same with expandable_segments:True."
    )
    cuda_context_bytes: int | None = Field(
        default=None, ge=0, description="Context outside the allocator (None: GPU default)."
    )
    margin_fraction: float = Field(
        default=DEFAULT_MARGIN_FRACTION,
        ge=0,
        lt=1,
        description="Safety margin added to the peak before the verdict (default: the 6 % the "
        "published GPU runs support; a trusted calibration sets its own).",
    )
    trusted: bool | None = Field(
        default=None,
        description="The trust rule's verdict on recent measurements (None: not assessed).",
    )
    observed_error: float | None = Field(
        default=None,
        le=0,
        description="Worst recent under-prediction, (predicted - measured) / measured (None: "
        "not assessed or no measurements).",
    )
    recent_records: int = Field(default=0, ge=0, description="Measurements the rule looked at.")
    compute_efficiency: float = Field(
        default=0.648,
        gt=0,
        le=1,
        description="Achieved over peak bf16 FLOP/s of the matrix multiplies (step-time "
        "model); the default is fitted to published Megatron-LM runs on A100s "
        "(calibration/throughput.py).",
    )
    layer_overhead_seconds: float = Field(
        default=5e-5,
        ge=0,
        le=1.0,
        description="Fixed time per layer, pass and micro-batch beyond its FLOPs: kernel "
        "launches and small operations (step-time model of a parallel layout).",
    )
    tp_host_layer_seconds: float = Field(
        default=0.0,
        ge=0,
        le=1.0,
        description="Least time per layer and pass of a micro-batch under TP > 1: the host's "
        "dispatch of the layer's kernels and collectives, which the GPU's work hides only when "
        "it is longer (step-time model of a parallel layout: a micro-batch takes the larger). "
        "0: not measured for the stack. Fitted for nanotron on the Ultra-Scale Playbook's "
        "sweep (calibration/sweep.py fit_step_floors).",
    )
    pp_cross_node_layer_seconds: float = Field(
        default=0.0,
        ge=0,
        le=1.0,
        description="Least time per layer and pass of a micro-batch whose pipeline's stages "
        "sit on different nodes: this plus pp_cross_node_layer_seconds_per_tp x TP (step-time "
        "model of a parallel layout; 0: not measured for the stack).",
    )
    pp_cross_node_layer_seconds_per_tp: float = Field(
        default=0.0,
        ge=0,
        le=1.0,
        description="See pp_cross_node_layer_seconds.",
    )
    elementwise_bytes_per_hidden: float = Field(
        default=256.0,
        ge=0,
        le=1e6,
        description="Fitted with compute_efficiency (calibration/throughput.py). Memory-bound "
        "traffic (norms, activations' functions, dropout, residual "
        "adds, bias adds) per token, layer and pass, per unit of hidden width, over the GPU's "
        "memory bandwidth; eager attention adds its score matrix's (step-time model of a "
        "parallel layout).",
    )
    host_link_efficiency: float = Field(
        default=0.8, gt=0, le=1, description="Achieved over nominal host-link bandwidth (pinned)."
    )
    cpu_optimizer_params_per_s: float = Field(
        default=2.0e9, gt=0, description="CPU AdamW throughput of the host, parameters per second."
    )


def coefficients_bytes(coeffs: Coefficients) -> int:
    """An upper bound of the bytes a set of coefficients holds (a cache entry that keeps it
    alive weighs it, ``planner._memo``)."""
    return 6144 + 4 * (len(coeffs.profile) + len(coeffs.device or "") + len(coeffs.source))


@cache
def _shipped() -> tuple[Coefficients, ...]:
    path = resources.files("headroom.planner") / "data" / "coefficients.json"
    data = json.loads(path.read_text())
    return tuple(Coefficients(**entry) for entry in data["coefficients"])


def profiles() -> list[str]:
    """Names of the activation profiles with shipped coefficients."""
    return sorted({c.profile for c in _shipped()})


@cache
def _devices() -> frozenset[str]:
    return frozenset(c.device for c in _shipped() if c.device is not None)


def default_coefficients(profile: str, device: str | None = None) -> Coefficients:
    """The shipped coefficients of ``profile``; a device-specific set wins over a generic one."""
    # a device without a set of its own is the generic one's: the memo holds shipped names
    # only, however many GPU names the service is sent
    return _default_coefficients(profile, device if device in _devices() else None)


@cache
def _default_coefficients(profile: str, device: str | None) -> Coefficients:
    generic: Coefficients | None = None
    for c in _shipped():
        if c.profile != profile:
            continue
        if device is not None and c.device == device:
            return c
        if c.device is None:
            generic = c
    if generic is None:
        raise SpecError(
            f"activation_profile: unknown profile {profile!r}; allowed: {', '.join(profiles())}",
            field="activation_profile",
        )
    return generic


def calibrated_coefficients(profile: str, device: str | None = None) -> Coefficients:
    """The fitted coefficients of ``profile`` (a set for ``device`` wins over a generic one);
    ``NotCalibrated`` where the profile has none."""
    chosen = default_coefficients(profile, device)
    if chosen.calibrated:
        return chosen
    fitted = [c for c in _shipped() if c.calibrated]
    raise NotCalibrated(
        f"activation_profile: no calibrated coefficients for profile {profile!r}; calibrated "
        f"profiles: {', '.join(sorted({c.profile for c in fitted})) or 'none'}",
        field="activation_profile",
    )


class NotCalibrated(SpecError):
    """Calibrated coefficients were asked for and there are none (undecidable, not invalid)."""
