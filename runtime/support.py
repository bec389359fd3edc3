"""What the bundled trainer can train, decided without importing torch (the service asks)."""

from __future__ import annotations

from planner.errors import SpecError
from planner.model import ModelSpec


def check_supported(spec: ModelSpec) -> None:
    """The runtime trains the decoder family; MLA and dropout models are estimate-only."""
    if spec.mla is not None:
        raise SpecError(
            "model.mla: the bundled trainer has no multi-head latent attention; "
            "estimate such models with the planner",
            field="model.mla",
        )
    if spec.dropout:
        raise SpecError("model.dropout: the bundled trainer trains without dropout", field="model")
