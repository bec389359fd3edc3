"""Options an activation profile's traces never ran: flagged in the budget, never silently
scaled.

A fitted profile's terms are checked on the traces they were fitted to and on the runs held
out of the fit. An option none of those traces ran is still priced by the planner's derived
arithmetic (Korthikanti et al.'s scores under eager attention, the latent projections of
multi-head latent attention, ...), with the profile's fitted scales applied to it unchecked. A
profile names such options (``Coefficients.untraced``, which the fit's records bear out), and
an estimate that uses one says so in ``Budget.warnings``, naming the field.

Options a profile has no term for at all are refused instead, with a ``SpecError`` naming the
field: MoE layers under a profile traced on dense layers only (``Coefficients.moe_traced``),
``recompute: selective_op`` under a profile that never ran it (``Coefficients.selective_op``).
"""

from __future__ import annotations

from headroom.planner.coefficients import Coefficients, UntracedOption
from headroom.planner.model import ModelSpec

#: what each option is, as a warning names it
_WHAT: dict[UntracedOption, str] = {
    "attention": "eager attention (they ran flash attention; the scores are priced as "
    "Korthikanti et al.'s softmax output, dropout mask and dropout output)",
    "model.mla": "model.mla (multi-head latent attention)",
    "model.num_mtp_layers": "model.num_mtp_layers (multi-token prediction layers)",
    "parallel.cp": "parallel.cp > 1 (context parallelism)",
    "precision.params": "precision.params: fp32 (32-bit activations)",
    "model.ffn_kind=gelu": "model.ffn_kind: gelu (a two-matrix GeLU MLP)",
    "model.ffn_kind=geglu": "model.ffn_kind: geglu (a gated GELU MLP)",
    "model.norm=layernorm": "model.norm: layernorm",
    "model.norm_params=weight": "model.norm_params: weight (a norm without a bias)",
    "model.norm_params=weight_and_bias": "model.norm_params: weight_and_bias",
    "model.norm_params=none": "model.norm_params: none (norms that learn nothing)",
    "model.norm_placement=sandwich": "model.norm_placement: sandwich (norms before and "
    "after attention and the MLP)",
    "model.norm_placement=post": "model.norm_placement: post (norms after attention and the "
    "MLP only)",
    "model.norm_placement=parallel": "model.norm_placement: parallel (attention and the MLP "
    "side by side on one norm's output)",
    "model.qk_norm_weights=per_head": "model.qk_norm_weights: per_head",
    "model.attn_logit_softcap": "model.attn_logit_softcap (soft-capped attention scores)",
    "model.final_logit_softcap": "model.final_logit_softcap (soft-capped logits)",
}

#: the architecture's options, each named ``field=value`` (or the field, for a number that is
#: set or not): a profile whose records run none of one flags it (``architecture_options``)
ARCHITECTURE_OPTIONS: tuple[UntracedOption, ...] = tuple(
    option
    for option in _WHAT
    if option.startswith("model.") and option != "model.mla" and option != "model.num_mtp_layers"
)


def architecture_options(model: ModelSpec) -> tuple[UntracedOption, ...]:
    """The options of ``ARCHITECTURE_OPTIONS`` ``model`` uses (a Llama uses none)."""
    weight, bias = model.norm_weights
    default_params = (True, model.norm == "layernorm")
    params = {(True, False): "weight", (True, True): "weight_and_bias", (False, False): "none"}
    used = {
        f"model.ffn_kind={model.ffn_kind}",
        f"model.norm={model.norm}",
        f"model.norm_placement={model.norm_placement}",
    }
    if (weight, bias) != default_params:
        used.add(f"model.norm_params={params.get((weight, bias), 'none')}")
    if model.qk_norm:
        used.add(f"model.qk_norm_weights={model.qk_norm_weights}")
    if model.attn_logit_softcap is not None:
        used.add("model.attn_logit_softcap")
    if model.final_logit_softcap is not None:
        used.add("model.final_logit_softcap")
    return tuple(option for option in ARCHITECTURE_OPTIONS if option in used)


def untraced_options(
    model: ModelSpec, eager_attention: bool, cp: int, act_bytes: int
) -> tuple[UntracedOption, ...]:
    """The options of ``UntracedOption`` an estimate of ``model`` with these knobs uses."""
    used: tuple[tuple[UntracedOption, bool], ...] = (
        ("attention", eager_attention),
        ("model.mla", model.mla is not None),
        ("model.num_mtp_layers", model.num_mtp_layers > 0),
        ("parallel.cp", cp > 1),
        ("precision.params", act_bytes > 2),
    )
    return tuple(option for option, uses in used if uses) + architecture_options(model)


def untraced_warnings(
    model: ModelSpec, coeffs: Coefficients, eager_attention: bool, cp: int, act_bytes: int
) -> list[str]:
    """One warning per option the estimate uses that ``coeffs``' traces never ran."""
    if not coeffs.untraced:  # the profiles without such options: nothing to look at
        return []
    return [
        f"{option.split('=')[0]}: the {coeffs.profile} profile's traces never ran "
        f"{_WHAT[option]}; priced by the planner's derived terms, unchecked against a trace"
        for option in untraced_options(model, eager_attention, cp, act_bytes)
        if option in coeffs.untraced
    ]
