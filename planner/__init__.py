"""Headroom's planner: predict per-bucket GPU and host memory for a training run.

Pure Python and pydantic (no torch, no web or database stack), so the CI gate runs anywhere::

    from headroom import planner
    budget = planner.estimate(planner.load_model("llama-3-8b"), planner.TrainSpec(),
                              planner.gpu("H100-80GB"))
    budget.gpu.peak_bytes, budget.peak_phase, budget.fits

Where each part lives (``docs/ESTIMATOR.md`` explains the model):

- ``estimate``, ``evaluate``, ``knobs`` (``planner.estimator``): the heaviest stage and phase,
  the verdict; a stage's terms come from ``planner.states`` (``params``, ``grads``,
  ``master_params``, ``optimizer_states``, ``ema``, ``transfer_buffers`` and the host buckets)
  and ``planner.activations`` (``activations``, ``logits``, ``moe_dispatch``), each from one
  function per bucket in ``planner.buckets`` (``params_bytes``, ``grads_bytes``,
  ``master_params_bytes``, ``optimizer_state_bytes``, ``ema_bytes``, ``moe_dispatch_bytes``,
  ``logits_bytes``, ``korthikanti_layer_bytes``, ``allocator_overhead_bytes``; ``cuda_context``
  is the coefficients' or the GPU preset's), combined phase by phase once in ``planner.phases``;
- ``Budget``, ``BudgetModel`` (``planner.budget``): the per-bucket, per-phase views and JSON;
- ``explain`` (``planner.explanation``): each bucket's formula, inputs and source;
- ``fit`` (``planner.ladder``): the auto-fit search, ranked by ``planner.steptime``;
- ``plan`` (``planner.layout``): the fastest parallel layout of N GPUs of a ``Cluster``
  (``planner.cluster``: presets of nodes and their links) that fits, with its step's terms;
- ``gate`` (``planner.verdict``): the CI gate's verdict;
- specs: ``ModelSpec`` (``planner.model``), ``TrainSpec`` (``planner.train``), ``Hardware``
  (``planner.hardware``), presets and files (``planner.io``, ``planner.hf``), ``Coefficients``
  (``planner.coefficients``); the trainer's ``TrainerReport`` and a run's ``Measurement``.
"""

from headroom.planner.budget import GPU_BUCKETS, HOST_BUCKETS, PHASES, Budget, BudgetModel
from headroom.planner.cluster import Cluster, cluster_names, load_cluster
from headroom.planner.coefficients import (
    DEFAULT_MARGIN_FRACTION,
    Coefficients,
    NotCalibrated,
    calibrated_coefficients,
    default_coefficients,
    profiles,
)
from headroom.planner.comparison import Comparison, compare
from headroom.planner.errors import HeadroomError, InputFormatError, SpecError, UnknownPresetError
from headroom.planner.estimator import Knobs, estimate, evaluate, knobs
from headroom.planner.explanation import Explanation, explain
from headroom.planner.hardware import Hardware, gpu, gpu_names
from headroom.planner.io import (
    RunPreset,
    load_hardware,
    load_model,
    load_run,
    load_train,
    model_names,
    run_names,
)
from headroom.planner.ladder import FitResult, fit
from headroom.planner.layout import PlanResult, StepPrice, plan, price_spec
from headroom.planner.measurement import Measurement
from headroom.planner.model import MLASpec, ModelSpec, MoESpec
from headroom.planner.params import ParamCount, count_params
from headroom.planner.report import TrainerReport
from headroom.planner.train import (
    FRAMEWORKS,
    DeepSpeed,
    Fsdp2,
    Loss,
    Megatron,
    Offload,
    Parallel,
    Precision,
    Recompute,
    TrainSpec,
)
from headroom.planner.units import format_bytes, parse_size
from headroom.planner.verdict import Verdict, gate

__all__ = [
    "DEFAULT_MARGIN_FRACTION",
    "FRAMEWORKS",
    "GPU_BUCKETS",
    "HOST_BUCKETS",
    "PHASES",
    "Budget",
    "BudgetModel",
    "Cluster",
    "Coefficients",
    "Comparison",
    "DeepSpeed",
    "Explanation",
    "FitResult",
    "Fsdp2",
    "Hardware",
    "HeadroomError",
    "InputFormatError",
    "Knobs",
    "Loss",
    "MLASpec",
    "Measurement",
    "Megatron",
    "MoESpec",
    "ModelSpec",
    "NotCalibrated",
    "Offload",
    "Parallel",
    "ParamCount",
    "PlanResult",
    "Precision",
    "Recompute",
    "RunPreset",
    "SpecError",
    "StepPrice",
    "TrainSpec",
    "TrainerReport",
    "UnknownPresetError",
    "Verdict",
    "calibrated_coefficients",
    "cluster_names",
    "compare",
    "count_params",
    "default_coefficients",
    "estimate",
    "evaluate",
    "explain",
    "fit",
    "format_bytes",
    "gate",
    "gpu",
    "gpu_names",
    "knobs",
    "load_cluster",
    "load_hardware",
    "load_model",
    "load_run",
    "load_train",
    "model_names",
    "parse_size",
    "plan",
    "price_spec",
    "profiles",
    "run_names",
]
