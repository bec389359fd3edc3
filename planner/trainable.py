"""What the bundled trainer can train, and in which precision, decided from the specs alone.

Pure (no torch): the launch layer checks a run against it before queueing, and writes the
trainer's arguments with it; the runtime applies the same rules (``runtime.support``).
"""

from __future__ import annotations

from typing import Literal

from headroom.planner.errors import SpecError
from headroom.planner.model import ModelSpec
from headroom.planner.train import Precision, TrainSpec

Working = Literal["fp32", "bf16"]
TORCH_DTYPE: dict[Working, str] = {"fp32": "float32", "bf16": "bfloat16"}  # headroom train --dtype
WORKING: dict[str, Working] = {name: w for w, name in TORCH_DTYPE.items()}  # --dtype -> working


#: architecture fields the bundled trainer does not build, with what it builds instead
_ESTIMATE_ONLY = (
    ("norm_placement", "pre", "its layers put a norm before attention and the MLP"),
    ("qk_norm_weights", "shared", "its query/key norms share one head_dim weight"),
    ("sliding_window", None, "its attention is causal over the whole sequence"),
    ("attn_logit_softcap", None, "it caps no attention score"),
    ("final_logit_softcap", None, "it caps no logit"),
)


def check_supported(spec: ModelSpec) -> None:
    """The runtime trains the decoder family (GQA or multi-head latent attention, dense or
    MoE, SwiGLU, GeGLU or GeLU MLPs, any norm's parameters); dropout, Gemma's and OLMo 2's
    norm placements, Cohere's parallel block, per-head query/key norm weights, sliding windows
    and soft-capping are estimate-only, refused naming the field."""
    if spec.dropout:
        raise SpecError("model.dropout: the bundled trainer trains without dropout", field="model")
    for field, built, what in _ESTIMATE_ONLY:
        value = getattr(spec, field)
        if value != built:
            raise SpecError(
                f"model.{field}: the bundled trainer does not build {value!r} ({what}); "
                f"allowed: {built if built is not None else 'null'}",
                field=f"model.{field}",
            )


def check_recompute(train: TrainSpec) -> None:
    """The trainer recomputes whole blocks (``full``, ``every_k``; ``selective`` keeps what
    ``none`` keeps, its attention storing no scores); torchtitan's per-op policy
    (``selective_op``) is torchtitan's code, not the trainer's: refused, naming ``recompute``,
    rather than run as another policy."""
    if train.recompute == "selective_op":
        raise SpecError(
            "recompute: selective_op is torchtitan's per-op selective checkpointing, which the "
            "bundled trainer does not run; allowed: none, selective, full or every_k",
            field="recompute",
        )


def check_loss(train: TrainSpec) -> None:
    """The trainer computes its own loss over the whole logits (``loss.impl: standard``); a
    stack's chunked or fused loss is that stack's code: refused, naming ``loss.impl``, rather
    than launched under an estimate of a loss the trainer does not run. The same for a step
    in the backward (``optimizer_in_backward``), which the trainer does not take."""
    if train.loss.impl != "standard":
        raise SpecError(
            f"loss.impl: {train.loss.impl} is another stack's loss, which the bundled trainer "
            "does not run; allowed: standard",
            field="loss.impl",
        )
    if train.loss.compiled:
        raise SpecError(
            "loss.compiled: the bundled trainer runs its loss eagerly; allowed: false",
            field="loss.compiled",
        )
    if train.optimizer_in_backward:
        raise SpecError(
            "optimizer_in_backward: torchtune's optimizer in backward, which the bundled "
            "trainer does not run; allowed: false",
            field="optimizer_in_backward",
        )


def working_precision(train: TrainSpec) -> Working:
    """The working precision a launch trains ``train`` in (``headroom train --dtype``): fp32
    weights stay fp32; 16-bit weights train in bf16 (fp16 has the same bytes and would need
    loss scaling, which the trainer does not do)."""
    return "fp32" if train.precision.params == "fp32" else "bf16"


def runtime_precision(train: TrainSpec, working: Working) -> Precision:
    """The precision of every state tensor the trainer keeps when it trains ``train`` with
    ``working`` weights, which is the spec's where the trainer can honour it:

    - ``params``: the working precision (``--dtype``);
    - ``grads``: autograd's gradients are the working precision; ``fp32`` with 16-bit weights
      adds an fp32 accumulator per parameter (the planner's 20 B/param case);
    - ``master``: a separate fp32 copy, or none (the optimizer then updates the weights);
      resident fp32 weights are their own master, whatever the spec says;
    - ``optimizer_states``: the AdamW moments in fp32, bf16 or fp16 (kept rounded, computed in
      fp32).

    Raises ``SpecError`` naming ``precision.master`` where the spec asks for what the trainer
    does not keep: a 16-bit master copy, or offloading without an fp32 master."""
    p = train.precision
    offloading = train.offload.mode != "none"
    # fp32 weights on the device are their own master copy; offloaded, the host keeps one
    master = "none" if working == "fp32" and not offloading else p.master
    if master not in ("fp32", "none"):
        raise SpecError(
            f"precision.master: the bundled trainer keeps an fp32 master copy or none, got "
            f"{p.master}; allowed: fp32, none",
            field="precision.master",
        )
    if master == "none" and offloading:
        raise SpecError(
            f"precision.master: offload.mode={train.offload.mode} updates the offloaded state "
            "against an fp32 master copy in host RAM; allowed with offloading: fp32",
            field="precision.master",
        )
    grads = "fp32" if working == "fp32" or p.grads == "fp32" else working
    return Precision(
        params=working, grads=grads, master=master, optimizer_states=p.optimizer_states
    )


def trainer_profile(train: TrainSpec) -> TrainSpec:
    """``train`` as the bundled trainer is priced: its activations are the ``runtime``
    profile's (fitted to traces of its own code) unless the spec names a profile. The default
    profile (the textbook's) prices a trainer that saves what the trainer does not: it
    predicted tiny-dense 22 % under the trainer's measured peak."""
    if "activation_profile" in train.model_fields_set:
        return train
    return train.model_copy(update={"activation_profile": "runtime"})


def runtime_train(train: TrainSpec, working: Working) -> TrainSpec:
    """``train`` with the precision the trainer keeps (what the planner should be given to
    predict the run)."""
    return train.model_copy(update={"precision": runtime_precision(train, working)})
