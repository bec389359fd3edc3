"""The training frameworks a trace can run a model under (no torch needed to import this).

``none`` is the plain single-rank step of ``calibration.tracing``; ``fsdp2`` is PyTorch's FSDP2
as torchtitan applies it, traced on the CPU with a fake process group
(``calibration.frameworks.fsdp2``, which needs torch and, for its models, transformers).
"""

from __future__ import annotations

from headroom.planner.errors import SpecError

#: the frameworks ``headroom calibrate trace --framework`` runs a step under (the estimate
#: models more: ``planner.train.FRAMEWORKS``)
FRAMEWORKS = ("none", "fsdp2")
#: the implementations each framework traces
FRAMEWORK_IMPLS: dict[str, tuple[str, ...]] = {
    "none": ("runtime", "hf", "torchtitan", "megatron", "torchtune"),
    "fsdp2": ("hf", "torchtitan"),
}


def check_framework(framework: str, impl: str) -> None:
    """A SpecError naming ``framework`` unless it is known and traces ``impl``."""
    if framework not in FRAMEWORKS:
        raise SpecError(
            f"framework: unknown {framework!r}; allowed: {', '.join(FRAMEWORKS)}",
            field="framework",
        )
    impls = FRAMEWORK_IMPLS[framework]
    if impl not in impls:
        raise SpecError(
            f"impl: a {framework} trace runs {', '.join(impls)} models (got {impl})",
            field="impl",
        )


def design_name(impl: str, framework: str = "none") -> str:
    """The name of the design and traces file of ``impl`` under ``framework``: ``hf``,
    ``hf-fsdp2``."""
    return impl if framework == "none" else f"{impl}-{framework}"
