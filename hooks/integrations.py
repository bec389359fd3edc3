"""Ready-made callbacks that mark a framework's phases on a :class:`MemoryReporter`.

Each is built on first use (the framework is imported then, not when Headroom is):

- :func:`hf_trainer_callback`: transformers' ``TrainerCallback``; ``on_pre_optimizer_step``
  ends the step's forward and backward (its peak covers both), ``on_optimizer_step`` its
  optimizer step (``Trainer(..., callbacks=[hf_trainer_callback(reporter)])``);
- :func:`lightning_callback`: Lightning's ``Callback``; ``on_before_optimizer_step`` ends the
  backward, ``on_train_batch_end`` the step (``Trainer(callbacks=[lightning_callback(r)])``).

torchtitan has no callback API: its train loop calls ``reporter.phase`` (README, "Calibrate on
your own GPUs").
"""

from __future__ import annotations

import importlib
from typing import Any

from headroom.hooks import MemoryReporter


def hf_trainer_callback(reporter: MemoryReporter) -> Any:
    """A ``transformers.TrainerCallback`` reporting to ``reporter``."""
    base = importlib.import_module("transformers").TrainerCallback

    class HeadroomCallback(base):  # type: ignore[misc, valid-type]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reporter.phase("backward", state.global_step + 1)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reporter.phase("optimizer", state.global_step + 1)

    return HeadroomCallback()


def lightning_callback(reporter: MemoryReporter) -> Any:
    """A ``lightning.pytorch.Callback`` reporting to ``reporter``."""
    try:
        base = importlib.import_module("lightning.pytorch").Callback
    except ImportError:
        base = importlib.import_module("pytorch_lightning").Callback

    class HeadroomCallback(base):  # type: ignore[misc, valid-type]
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            reporter.phase("backward", trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            reporter.phase("optimizer", trainer.global_step)

    return HeadroomCallback()


__all__ = ["hf_trainer_callback", "lightning_callback"]
