"""Least-squares regression of the planner's activation coefficients onto traced steps.

The planner's forward-phase transient bytes (``activations`` + ``logits`` + ``moe_dispatch``)
are linear in its activation coefficients, so each coefficient's contribution to a
configuration is the estimate made with that coefficient at 1 and the others at 0 (a
*feature*). Fitting solves, for non-negative coefficients, the least-squares problem on the
relative error of the traced transient bytes at the end of step 2's forward (optimizer state
exists then; nothing of backward is live yet). The layers' backward terms (the FFN- and
hidden-width tensors a layer's backward holds beyond its saved ones, a recomputed block's
extra, and the share of its MLP's gradients made by its peak) are then fitted to the largest
total the trace saw inside a decoder layer's backward, with the forward terms fixed; that
estimate is a largest of several points, so the fit is solved again around each solution (see
``_fit_backward``). The loss backward's bytes per logit are then
the value (in steps of 1/8) with the least squared relative error of the predicted peaks
(peaks that do not depend on it leave the choice to those that do).

A profile's structural terms (``STRUCTURAL``) are what its code does, read from the code, and
are never varied or fitted: the features are taken with them in place, and a feature whose
coefficients they all fix is no feature. Terms of one kind of layer (``FAMILY``: a GeLU MLP's)
are fitted only where the records have that kind; otherwise the profile keeps the defaults.

The norms' saved inputs are exactly twice the MLP input's bytes in every layer, so only their
weighted sum is determined and both scales get the same value. Other features are correlated
across the design too, so single coefficients mean less than predictions: what is checked is
the estimate on configurations held out of the fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headroom import planner
from headroom.calibration.trace_records import TraceRecord
from headroom.planner.buckets import ROUTING_SLAB_ELEMENTS
from headroom.planner.estimator import layer_backward_bytes

#: feature name → the coefficient values that isolate it (all others 0)
FEATURES: dict[str, dict[str, float]] = {
    "norm": {"norm_scale": 1},
    "mlp_input": {"mlp_scale": 1},
    "attention": {"attention_scale": 1},
    "qk_norm": {"qk_norm_tensors": 1},
    "ffn": {"mlp_scale": 1, "swiglu_saved_ffn_tensors": 1},  # minus mlp_input
    "ffn_gelu": {"mlp_scale": 1, "gelu_saved_ffn_tensors": 1},  # minus mlp_input
    "moe": {"moe_scale": 1, "swiglu_saved_ffn_tensors": 1},
    "head": {"head_hidden_tensors": 1},
    "logits": {"logits_bytes_per_element": 1},
}
#: the smallest MLP scale a fit ships (the FFN bytes are mlp_scale x swiglu_saved_ffn_tensors)
MIN_MLP_SCALE = 1e-3
#: backward feature name → the coefficient it isolates (fitted to the layers' backward peaks)
BACKWARD = (
    "backward_ffn_tensors",
    "backward_expert_ffn_tensors",
    "backward_hidden_tensors",
    "recompute_hidden_tensors",
    "backward_slot_tensors",
    "backward_end_slot_tensors",
    "backward_output_slot_tensors",
    "backward_mlp_grads",
)
#: the widths the backward terms are fitted at: in narrower layers every tensor's gradient
#: (attention's and the norms', not only the MLP's that ``backward_mlp_grads`` counts) is as
#: large as the token-sized tensors, and toy widths would steer the terms real widths use
BACKWARD_MIN_HIDDEN = 512
#: how many times the backward fit solves again around its last solution (at most)
BACKWARD_REFINEMENTS = 8
#: per profile, what its implementation does rather than what a fit finds. Headroom's trainer
#: scales its experts' outputs by the routing weights slab by slab
#: (``planner.buckets.ROUTING_SLAB_ELEMENTS``): as an MoE layer's backward starts it holds two
#: slot-wide tensors (the outputs' gathered gradient and their gradient after the scale) and a
#: slab of the weights' gradient's product, 16-bit, or with fp32 weights the incoming
#: gradient's fp32 copy and an fp32 product (8 bytes an element, 6 more than 16-bit routing)
STRUCTURAL: dict[str, dict[str, Any]] = {
    "runtime": {
        "backward_output_slot_tensors": 2.0,
        "routing_fp32_bytes_per_element": 6.0,
        "routing_product_slab_elements": ROUTING_SLAB_ELEMENTS,
    },
    "hf": {},
    # torchtune's layer under torch.compile (its compile: true), traced with real tensors on a
    # CPU (``calibration.torchtune.compiled_layer_tensors``, solved from two shapes and held to
    # others by tests/calibration/test_torchtune_profile.py): it saves 7 hidden-width and 1
    # FFN-width 16-bit tensors a token fewer than eagerly. The two RMSNorms' fp32 input and
    # output (8 in 16-bit units) and the SiLU output are recomputed in the compiled backward;
    # the compiled graph returns one more hidden-width tensor of its own
    "torchtune": {
        "compiled_layer_hidden_tensors": 7.0,
        "compiled_layer_ffn_tensors": 1.0,
    },
    # both run the embedding on the rank's shard of the vocabulary under tensor parallelism
    # (torchtitan: ``local_map`` in ``set_decoder_sharding_config``; Megatron-Core:
    # ``VocabParallelEmbedding``), so its backward makes only that shard's gradient
    # torchtitan's tensor-parallel MLP (``set_dense_ffn_sharding``) as its backward ends on
    # the 405B and 70B widths (torchtitan-fsdp2-traces.json, the runs marked fitted): the
    # output's all-gathered gradient and w1's and w3's input gradients (partial sums), whole
    # sequence, beside w1/w2/w3's gradients (transformers' MLP under torch's plan: the hf
    # profile's one-rank terms already cover its traces, so none)
    # under its per-op selective checkpointing the compiled FlexAttention region the policy
    # saves returns the queries, keys and values its backward needs, so they are kept too
    # (``calibration.tracing.compiled_attention_region``)
    "torchtitan": {
        "embedding_grad_whole_vocab": False,
        "tp_backward_end_hidden_tensors": 3.0,
        "selective_op_saves_attention_inputs": True,
    },
    # Megatron-Core's layers as calibration/megatron.py traces them, each term read from its
    # code (docs/ESTIMATOR.md, "Which model code"): the norms keep their input (and per-row
    # statistics); the attention its Q/K/V projection's input and output, the rotated queries
    # and keys RoPE writes beside them (``apply_rotary_pos_emb``), and the flash kernel's
    # output; the MLP its input and, SwiGLU, the fused kernel's input (two FFN-width halves)
    # and output (``BiasSwiGLUFunction``), GeLU the fused kernel's input and output
    # (``GeLUFunction``); dropout a bool mask per hidden element after the attention and the
    # MLP (bias-dropout-add); biases nothing (its linears return them apart). Under sequence
    # parallelism a rank holds one whole-sequence all-gather buffer (its global memory
    # buffer). Fitted: the head's and the loss's bytes, query/key norms, the backward's.
    # Its harness runs flash attention, refuses MLA and multi-token prediction, and runs one
    # context-parallel rank in bf16: those options are priced unchecked, and flagged
    "megatron": {
        "embedding_grad_whole_vocab": False,
        "attention_scale": 1.0,
        "rope_qk_tensors": 1.0,
        "norm_scale": 1.0,
        "mlp_scale": 1.0,
        "swiglu_saved_ffn_tensors": 3.0,
        "gelu_saved_ffn_tensors": 2.0,
        "sp_gather_buffer_tensors": 1.0,
        "untraced": [
            "attention",
            "model.mla",
            "model.num_mtp_layers",
            "parallel.cp",
            "precision.params",
        ],
    },
}
#: terms of one kind of layer only, fitted where a profile's records have that kind (else
#: the profile keeps the coefficients' defaults): a GeLU MLP's saved and backward FFN-width
#: tensors
FAMILY = ("gelu_saved_ffn_tensors", "gelu_backward_ffn_tensors")
ZERO = {
    "attention_scale": 0.0,
    "qk_norm_tensors": 0.0,
    "mlp_scale": 0.0,
    "norm_scale": 0.0,
    "moe_scale": 0.0,
    "swiglu_saved_ffn_tensors": 0.0,
    "gelu_saved_ffn_tensors": 0.0,
    "head_hidden_tensors": 0.0,
    "logits_bytes_per_element": 0.0,
    "logits_backward_bytes_per_element": 0.0,
}
#: a hardware whose only role is to hold the estimate (no context, no allocator slack)
TRACE_DEVICE = planner.Hardware(
    name="cpu-trace",
    memory_bytes=2**50,
    bf16_flops=1e12,
    memory_bandwidth_bytes_per_s=1e11,
    host_link="none",
    host_link_bytes_per_s=1e10,
    cuda_context_bytes=0,
    allocator_overhead_fraction=0.0,
    source="CPU traces: allocated bytes only",
)


def _transient(model: planner.ModelSpec, train: planner.TrainSpec, values: dict[str, float]) -> int:
    profile = train.activation_profile
    # a profile's structural terms are what its code does: never varied, never fitted
    coeffs = planner.Coefficients(
        profile=profile, **{**ZERO, **values, **STRUCTURAL.get(profile, {})}
    )
    row = planner.estimate(model, train, TRACE_DEVICE, coeffs).gpu.phases["forward"].buckets
    return row["activations"] + row["logits"] + row["moe_dispatch"]


def features(model: planner.ModelSpec, train: planner.TrainSpec) -> dict[str, float]:
    """Each feature's forward-phase transient bytes with its coefficient at 1, and ``fixed``:
    the bytes no coefficient scales (MoE dispatch buffers)."""
    fixed = float(_transient(model, train, {}))
    out = {
        name: float(_transient(model, train, values)) - fixed for name, values in FEATURES.items()
    }
    out["ffn"] -= out["mlp_input"]
    out["ffn_gelu"] -= out["mlp_input"]
    # the MoE feature's own expert bytes, without the layer's common terms (counted above)
    out["moe"] -= float(_transient(model, train, {"swiglu_saved_ffn_tensors": 1})) - fixed
    out["fixed"] = fixed
    return out


def _nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > 1e-12
    return x


def _relative_nnls(
    rows: Sequence[Sequence[float]], fixed: Sequence[float], targets: Sequence[float]
) -> list[float]:
    """Non-negative x minimising the relative errors (rows · x + fixed − target) / target;
    a feature that is zero in every row gets 0."""
    a, y = np.array(rows, dtype=float), np.array(targets, dtype=float)
    used = [j for j in range(a.shape[1]) if a[:, j].any()]
    solution = np.zeros(a.shape[1])
    solution[used] = _nnls(a[:, used] / y[:, None], 1 - np.array(fixed) / y)
    return [float(v) for v in solution]


def predicted_peak(record: TraceRecord, coeffs: planner.Coefficients) -> int:
    """The planner's allocated peak for a traced configuration under ``coeffs``."""
    return planner.estimate(record.model, record.train, TRACE_DEVICE, coeffs).gpu_peak_bytes


def fit_coefficients(
    records: Sequence[TraceRecord], profile: str = "runtime", source: str = ""
) -> planner.Coefficients:
    """Coefficients of ``profile`` fitted to traced ``records`` (module docstring).

    Records of ``recompute: selective_op`` are not fitted to: what a layer keeps under
    torchtitan's per-op policy is derived from the policy
    (``planner.activations.selective_op_layer_bytes``) and its re-run block is a full-recompute
    block, so no term is theirs and fitting the others to them too would only trade the other
    runs' fit for theirs. They say the profile prices the policy (``selective_op``), and they
    check it."""
    priced_op = any(record.train.recompute == "selective_op" for record in records)
    records = [record for record in records if record.train.recompute != "selective_op"]
    names = list(FEATURES)
    rows, fixed, targets = [], [], []
    for record in records:
        f = features(record.model, record.train)
        rows.append([f[n] for n in names])
        fixed.append(f["fixed"])
        targets.append(float(record.forward_transient_bytes))
    c = dict(zip(names, _relative_nnls(rows, fixed, targets), strict=True))
    # the norms save twice the MLP input's hidden-width bytes in every layer: only
    # 2 x norm + mlp_input is determined, so both scales get its third
    hidden = (2 * c["norm"] + c["mlp_input"]) / 3
    mlp = max(hidden, MIN_MLP_SCALE)
    ffn_tensors = c["ffn"] / mlp
    values: dict[str, Any] = {
        "norm_scale": hidden,
        "attention_scale": c["attention"],
        "mlp_scale": mlp,
        "swiglu_saved_ffn_tensors": ffn_tensors,
        "moe_scale": c["moe"] / ffn_tensors if ffn_tensors > 0 else 0.0,
        "head_hidden_tensors": c["head"],
        "logits_bytes_per_element": c["logits"],
        "moe_traced": any(record.model.moe is not None for record in records),
        "selective_op": priced_op,
    }
    if any(row[names.index("qk_norm")] for row in rows):  # else the records say nothing of it
        values["qk_norm_tensors"] = c["qk_norm"]
    if any(row[names.index("ffn_gelu")] for row in rows):  # the same of GeLU MLPs
        values["gelu_saved_ffn_tensors"] = c["ffn_gelu"] / mlp
    values.update(STRUCTURAL.get(profile, {}))
    values.update(_fit_backward(records, profile, values))
    best: tuple[float, float] | None = None
    for eighths in range(0, 129):
        candidate = planner.Coefficients(
            profile=profile, **values, logits_backward_bytes_per_element=eighths / 8
        )
        squares = sum(
            ((predicted_peak(r, candidate) - r.peak_bytes) / r.peak_bytes) ** 2 for r in records
        )
        if best is None or squares < best[0] - 1e-12:
            best = (squares, eighths / 8)
    assert best is not None
    return planner.Coefficients(
        profile=profile,
        calibrated=True,
        source=source or f"fitted from {len(records)} trace(s)",
        num_records=len(records),
        **values,
        logits_backward_bytes_per_element=best[1],
    )


def _fit_backward(
    records: Sequence[TraceRecord],
    profile: str,
    values: dict[str, Any],
) -> dict[str, float]:
    """The layers' backward terms, fitted (non-negative least squares on relative errors) to
    the largest total each record's trace saw inside a decoder layer's backward, with the
    forward terms already fitted.

    The estimate is the largest of several points (layers, and within a layer its MLP's
    backward or the end of it), so it is linear in the terms only piecewise: the fit starts
    from each term's effect at 1 with the others at 0, then solves again around each solution
    with the points that solution makes the largest (their slopes), and keeps the best."""
    chosen = [
        (r.model, r.train, float(r.layer_backward_peak_bytes))
        for r in records
        if r.layer_backward_peak_bytes and r.model.hidden_size >= BACKWARD_MIN_HIDDEN
    ]
    if not chosen:
        return {}
    base = planner.Coefficients(profile=profile, **values)
    fitted = [name for name in BACKWARD if name not in STRUCTURAL.get(profile, {})]
    if any(model.ffn_kind == "gelu" for model, _, _ in chosen):
        fitted.append("gelu_backward_ffn_tensors")

    def estimates(point: dict[str, float]) -> list[int]:
        c = base.model_copy(update=point)
        return [layer_backward_bytes(m, t, c) for m, t, _ in chosen]

    def squares(point: dict[str, float]) -> float:
        return sum(
            ((e - y) / y) ** 2 for e, (_, _, y) in zip(estimates(point), chosen, strict=True)
        )

    def solve(around: dict[str, float], step: float) -> dict[str, float]:
        """NNLS on the slopes at ``around`` (a step of ``step`` each, down at a bound)."""
        at = estimates(around)
        steps = {
            name: -step if name == "backward_mlp_grads" and around[name] + step > 1 else step
            for name in fitted
        }
        moved = [estimates({**around, name: around[name] + steps[name]}) for name in fitted]
        rows = [
            [(moved[j][i] - at[i]) / steps[name] for j, name in enumerate(fitted)]
            for i in range(len(chosen))
        ]
        fixed = [
            at[i] - sum(r * around[n] for r, n in zip(rows[i], fitted, strict=True))
            for i in range(len(chosen))
        ]
        solution = _relative_nnls(rows, fixed, [y for _, _, y in chosen])
        point = dict(zip(fitted, solution, strict=True))
        # a fraction of the layer's own gradients: at most all of them
        point["backward_mlp_grads"] = min(point["backward_mlp_grads"], 1.0)
        return point

    point = solve({name: 0.0 for name in fitted}, 1.0)
    best = (squares(point), point)
    for _ in range(BACKWARD_REFINEMENTS):
        point = solve(point, 0.05)
        error = squares(point)
        if error >= best[0] - 1e-12:
            break
        best = (error, point)
    return best[1]


def peak_errors(records: Sequence[TraceRecord], coeffs: planner.Coefficients) -> list[float]:
    """(predicted - traced) / traced peak of each record."""
    return [(predicted_peak(r, coeffs) - r.peak_bytes) / r.peak_bytes for r in records]


#: the fitted fields a shipped set carries (the rest are the profile's defaults)
FITTED = (
    "attention_scale",
    "qk_norm_tensors",
    "mlp_scale",
    "norm_scale",
    "moe_scale",
    "swiglu_saved_ffn_tensors",
    "head_hidden_tensors",
    "logits_bytes_per_element",
    "logits_backward_bytes_per_element",
    *BACKWARD,
)
