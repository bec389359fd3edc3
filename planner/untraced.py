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
}


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
    return tuple(option for option, uses in used if uses)


def untraced_warnings(
    model: ModelSpec, coeffs: Coefficients, eager_attention: bool, cp: int, act_bytes: int
) -> list[str]:
    """One warning per option the estimate uses that ``coeffs``' traces never ran."""
    if not coeffs.untraced:  # the profiles without such options: nothing to look at
        return []
    return [
        f"{option}: the {coeffs.profile} profile's traces never ran {_WHAT[option]}; "
        "priced by the planner's derived terms, unchecked against a trace"
        for option in untraced_options(model, eager_attention, cp, act_bytes)
        if option in coeffs.untraced
    ]
