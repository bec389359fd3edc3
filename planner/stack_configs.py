"""A stack's own training config read as a training spec: a torchtitan job TOML, a Megatron-LM
argument list, a DeepSpeed config JSON (with an HF ``TrainingArguments`` file beside it).

A user should not rewrite a run in Headroom's schema: ``--train`` takes the file the run
already has. Each format is recognised from its content (:func:`recognise`) and mapped key by
key to the training spec's keys; what has no counterpart in a training spec is named, never
dropped in silence (:attr:`StackConfig.unmapped`, which the CLI prints as one warning line),
and where the file leaves a value to the launch (torchtitan's ``-1``: every GPU the job has)
the value taken is said too (:attr:`StackConfig.assumed`).

Only the standard library (``tomllib``, ``json``, ``shlex``): no stack is imported.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shlex
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headroom.planner.errors import InputFormatError

#: the data-parallel degree a torchtitan file leaves to the launch (``-1``) is taken as
#: one node of this many GPUs unless ``--set parallel.dp`` says otherwise
DEFAULT_NODE_GPUS = 8


@dataclass
class StackConfig:
    """A stack's config as a training spec: what it maps to, and what it does not."""

    kind: str  # torchtitan, megatron, deepspeed, hf (HF TrainingArguments without DeepSpeed)
    train: dict[str, Any]
    model_hint: str | None = None  # what the file says the model is, where it says
    unmapped: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    #: DeepSpeed knobs left "auto", which HF's integration sizes from the model's hidden width
    auto: list[str] = field(default_factory=list)

    def with_model(self, hidden: int) -> StackConfig:
        """The config with its ``auto`` knobs sized as transformers' DeepSpeed integration
        sizes them (``integrations/deepspeed.py``: ``hidden_size * hidden_size``,
        ``0.9 * hidden_size * hidden_size``, ``10 * hidden_size``)."""
        if not self.auto:
            return self
        sizes = {
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
        knobs = dict(self.train.get("deepspeed", {}))
        knobs.update({name: sizes[name] for name in self.auto if name in sizes})
        assumed = [a for a in self.assumed if " auto (HF sizes it" not in a]
        train = {**self.train, "deepspeed": knobs}
        return StackConfig(self.kind, train, self.model_hint, self.unmapped, assumed, [])

    def warning(self, name: str) -> str | None:
        """The one line that names what was not read and what was assumed (None: neither)."""
        parts = []
        if self.unmapped:
            parts.append("no counterpart in a training spec, not read: " + ", ".join(self.unmapped))
        if self.assumed:
            parts.append("assumed: " + "; ".join(self.assumed))
        return f"{name}: {self.kind} config: " + "; ".join(parts) if parts else None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def _int(value: Any, name: str, least: int | None = None) -> int:
    """``value`` as a whole number (of at least ``least``); an InputFormatError naming the
    file's key ``name`` otherwise."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise InputFormatError(f"{name}: expected a whole number, got {value!r}") from None
    if least is not None and number < least:
        raise InputFormatError(
            f"{name}: expected a whole number of at least {least}, got {value!r}"
        )
    return number


def _names(value: Any) -> list[str]:
    """A list a config gives as a list, or as one string of names split by spaces."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list | tuple):
        return [str(item) for item in value]
    return [] if value is None or value is False else [str(value)]


def _float(value: Any, name: str) -> float:
    """``value`` as a finite number; an InputFormatError naming the file's key otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputFormatError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InputFormatError(f"{name}: expected a finite number, got {value!r}")
    return number


class _Keys:
    """A file's keys, each taken at most once; the rest are what was not read."""

    def __init__(self, flat: dict[str, Any]) -> None:
        self.flat = flat
        self.taken: set[str] = set()

    def get(self, *names: str, default: Any = None) -> Any:
        """The first of ``names`` the file has (every one of them counts as read)."""
        found = default
        hit = False
        for name in names:
            if name in self.flat:
                self.taken.add(name)
                if not hit:
                    found, hit = self.flat[name], True
        return found

    def whole(self, *names: str, default: Any, least: int | None = None) -> int:
        """:meth:`get` as a whole number (of at least ``least``), refused naming the key."""
        return _int(self.get(*names, default=default), self._named(names), least)

    def number(self, *names: str, default: Any) -> float:
        """:meth:`get` as a finite number, refused naming the key."""
        return _float(self.get(*names, default=default), self._named(names))

    def _named(self, names: tuple[str, ...]) -> str:
        return next((name for name in names if name in self.flat), names[0])

    def ignore(self, *prefixes: str) -> None:
        """Count as read the keys under these prefixes (no effect on memory, said in docs)."""
        for key in self.flat:
            if any(key == p or key.startswith(p + ".") for p in prefixes):
                self.taken.add(key)

    def rest(self) -> list[str]:
        return sorted(k for k in self.flat if k not in self.taken)


# --- torchtitan -------------------------------------------------------------------------------

#: torchtitan's sections and keys that change nothing a GPU holds (logging, checkpoint files,
#: data, the learning rate, timeouts): read as read
_TITAN_NO_MEMORY = (
    "job",
    "profiling",
    "metrics",
    "checkpoint",
    "validation",
    "lr_scheduler",
    "comm",
    "fault_tolerance",
    "memory_estimation",
    "optimizer.lr",
    "optimizer.eps",
    "optimizer.weight_decay",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.early_step_in_backward",
    "training.steps",
    "training.warmup_steps",
    "training.dataset",
    "training.dataset_path",
    "training.seed",
    "training.deterministic",
    "training.gc_freq",
    "training.gc_debug",
    "training.enable_cpu_offload",
    "model.tokenizer_path",
    "model.hf_assets_path",
)
_TITAN_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
_TITAN_IMPL = {"fused": "fused", "foreach": "foreach", "for-loop": "for_loop"}
_INTERLEAVED = ("interleaved1f1b", "interleavedzerobubble")
#: torchtitan's V schedules (two chunks per rank in a V), by their lower-case names
_V_SCHEDULES = {"zbvzerobubble": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
#: torchtitan's schedules that run every forward before any backward, by their lower-case
#: names (``torch.distributed.pipelining.get_schedule_class`` takes any case)
_ALL_FORWARDS_FIRST = {"gpipe": "GPipe", "loopedbfs": "LoopedBFS"}


def is_torchtitan(data: Mapping[str, Any]) -> bool:
    """A torchtitan job TOML has its ``[training]`` table and a parallelism or model table."""
    return isinstance(data.get("training"), Mapping) and any(
        isinstance(data.get(t), Mapping)
        for t in ("parallelism", "model", "activation_checkpoint", "job")
    )


def from_torchtitan(data: Mapping[str, Any]) -> StackConfig:
    """A torchtitan job config (``torchtitan/config/job_config.py``'s ``JobConfig`` as TOML;
    older releases kept the parallel degrees under ``[training]`` and ``[experimental]``)."""
    keys = _Keys(dict(_flatten(data)))
    keys.ignore(*_TITAN_NO_MEMORY)
    train: dict[str, Any] = {"framework": "fsdp2", "activation_profile": "torchtitan"}
    assumed: list[str] = []

    def degree(name: str) -> int:
        where = (f"parallelism.{name}", f"training.{name}", f"experimental.{name}")
        return keys.whole(*where, default=1, least=1)

    tp, pp, cp = (
        degree("tensor_parallel_degree"),
        degree("pipeline_parallel_degree"),
        degree("context_parallel_degree"),
    )
    ep = degree("expert_parallel_degree")
    replicate = degree("data_parallel_replicate_degree")
    shard = keys.whole(
        "parallelism.data_parallel_shard_degree",
        "training.data_parallel_shard_degree",
        "training.data_parallel_degree",
        default=-1,
        least=-1,
    )
    if shard == -1:
        shard = max(1, DEFAULT_NODE_GPUS // (tp * pp * cp * replicate))
        assumed.append(
            f"data_parallel_shard_degree -1 (every GPU the job has) as {shard} ({DEFAULT_NODE_GPUS}"
            " GPUs); say --set parallel.dp=N for N data-parallel ranks"
        )
    dp = shard * replicate
    parallel: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    if ep > 1:
        parallel["ep"] = ep
    parallel["zero_stage"] = 3
    if replicate > 1 and shard == 1:
        assumed.append("data_parallel_replicate_degree without sharding priced as FSDP2's")
    if tp > 1:
        parallel["sequence_parallel"] = True  # torchtitan's TP plan: norms sequence-parallel
    keys.get("parallelism.enable_async_tensor_parallel", "parallelism.disable_loss_parallel")
    local = keys.whole("training.local_batch_size", "training.batch_size", default=8, least=1)
    global_batch = keys.whole("training.global_batch_size", default=-1)
    if pp > 1:
        # the local batch is split into the pipeline's micro-batches: of
        # pipeline_parallel_microbatch_size each, or pipeline_parallel_microbatches of them
        # (earlier releases), whose default was the pipeline degree
        size_key = "parallelism.pipeline_parallel_microbatch_size"
        size = keys.get(size_key)
        count_keys = (
            "parallelism.pipeline_parallel_microbatches",
            "experimental.pipeline_parallel_microbatches",
        )
        count = keys.get(*count_keys)
        if size is not None:
            micro = _int(size, size_key, least=1)
        else:
            n = _int(count, keys._named(count_keys), least=1) if count else pp
            micro = max(1, local // n)
            if not count:
                assumed.append(
                    f"{pp} pipeline micro-batches (the pipeline degree, torchtitan's default "
                    "before pipeline_parallel_microbatch_size; since, micro-batches of 1)"
                )
        train["micro_batch_size"] = micro
        train["grad_accum_steps"] = max(1, local // micro)
        schedule = str(
            keys.get(
                "parallelism.pipeline_parallel_schedule",
                "experimental.pipeline_parallel_schedule",
                default="1F1B",
            )
        )
        keys.get("parallelism.pipeline_parallel_layers_per_stage")
        if schedule.lower() in _ALL_FORWARDS_FIRST:
            # every micro-batch's activations held before the first backward, whatever the
            # stages per rank: the schedule's memory, priced with one stage per rank
            parallel["pp_schedule"] = _ALL_FORWARDS_FIRST[schedule.lower()]
        elif schedule.lower() in _V_SCHEDULES:
            # the V: the first rank holds the embedding and the head (``planner.schedules``)
            parallel["pp_schedule"] = _V_SCHEDULES[schedule.lower()]
            parallel["vpp"] = 2
            assumed.append(
                f"pipeline schedule {schedule}: the layers split as evenly as possible into "
                "2 x pp chunks, earlier chunks taking the remainder (torchtitan's own split "
                "points are not in the file)"
            )
        elif schedule.lower() in _INTERLEAVED:
            # its chunks hold the layers torchtitan splits, which the file does not say and
            # the interleaved price needs evenly split: the plain schedule's is taken
            assumed.append(
                f"pipeline schedule {schedule} priced as 1F1B (where the model's layers split "
                "evenly into pp x 2 chunks: --set parallel.vpp=2)"
            )
    else:
        train["micro_batch_size"] = local
        accum = global_batch // (local * dp) if global_batch > 0 and dp > 0 else 1
        train["grad_accum_steps"] = max(1, accum)
    train["parallel"] = parallel
    if "training.seq_len" in keys.flat:
        train["seq_len"] = keys.whole("training.seq_len", default=None, least=1)
    param = keys.get("training.mixed_precision_param", default="bfloat16")
    reduce = keys.get("training.mixed_precision_reduce", default="float32")
    train["precision"] = {
        "params": _TITAN_DTYPES.get(str(param), "bf16"),
        "grads": _TITAN_DTYPES.get(str(reduce), "fp32"),
        "master": "fp32",
        "optimizer_states": "fp32",
    }
    norm = keys.number("training.max_norm", default=1.0)
    train["max_grad_norm"] = norm if norm > 0 else None
    name = str(keys.get("optimizer.name", default="AdamW"))
    train["optimizer"] = "adamw" if name.lower() in ("adamw", "adam") else name.lower()
    # torchtitan's optimizer.implementation (fused by default); releases before it had
    # optimizer.fused, a flag off by default (foreach), which a file that names neither hides
    fused = keys.get("optimizer.fused")
    impl = keys.get("optimizer.implementation")
    if fused is not None:
        train["optimizer_impl"] = "fused" if fused else "foreach"
    elif impl is not None:
        train["optimizer_impl"] = _TITAN_IMPL.get(str(impl), "fused")
    else:
        train["optimizer_impl"] = "fused"
        assumed.append(
            "the fused AdamW (optimizer.implementation's default; releases with optimizer.fused "
            "ran foreach unless it was set: --set optimizer_impl=foreach)"
        )
    mode = str(keys.get("activation_checkpoint.mode", default="selective"))
    option = str(keys.get("activation_checkpoint.selective_ac_option", default="op"))
    if mode == "full":
        train["recompute"] = "full"
    elif mode == "selective" and option == "op":
        train["recompute"] = "selective_op"
    elif mode == "selective" and option.isdigit():
        train["recompute"] = {"every_k": int(option)}
        assumed.append(f"selective_ac_option {option} (every {option}th block) as every_k")
    else:
        train["recompute"] = "none"
        if mode not in ("none", "selective"):
            assumed.append(f"activation_checkpoint.mode {mode} priced as none")
    compiled = keys.get("compile.enable", "training.compile", default=False)
    components = keys.get("compile.components", default=["model", "loss"])
    if compiled and "loss" in _names(components):
        train["loss"] = {"compiled": True}
        if "compile.enable" not in keys.flat:
            assumed.append(
                "training.compile compiles the loss too, as torchtitan has since 2025-04-02 "
                "(earlier releases: --set loss.compiled=false)"
            )
    train["expandable_segments"] = True
    assumed.append("expandable segments, as torchtitan's run_train.sh sets PYTORCH_CUDA_ALLOC_CONF")
    reshard = str(keys.get("parallelism.fsdp_reshard_after_forward", default="default"))
    # "default": resharded after forward unless pipelined (torchtitan's apply_fsdp)
    resharded = reshard == "always" or (reshard == "default" and pp == 1)
    train["fsdp2"] = {"groups": "split", "reshard_after_forward": resharded}
    assumed.append(
        "FSDP groups as torchtitan makes them since #1094 of 2025-07-28 (fsdp2.groups split; "
        "earlier releases: --set fsdp2.groups=root)"
    )
    model_name = keys.get("model.name")
    flavor = keys.get("model.flavor")
    converters = _names(keys.get("model.converters", default=[]))
    unmapped = []
    if converters:
        # float8 / mx training: the converted linears' saved tensors and gathers are not priced
        unmapped.append(f"model.converters {converters} (not priced: bf16 assumed)")
    elif keys.get("float8.enable_float8_linear"):  # the releases before model.converters
        unmapped.append("float8 training (float8.enable_float8_linear; not priced: bf16 assumed)")
    else:
        keys.ignore("quantize", "float8", "mx")  # a converter's settings, unused without one
    hint = f"{model_name} {flavor}" if model_name and flavor else None
    return StackConfig("torchtitan", train, hint, unmapped + keys.rest(), assumed)


# --- Megatron-LM ------------------------------------------------------------------------------

#: Megatron-LM's flags that change nothing a GPU holds (logging, checkpoints, data, the learning
#: rate schedule, timers), by prefix
_MEGATRON_NO_MEMORY = (
    "--log-",
    "--save",
    "--load",
    "--data-",
    "--lr",
    "--min-lr",
    "--weight-decay",
    "--tokenizer-",
    "--eval-",
    "--train-iters",
    "--train-samples",
    "--split",
    "--tensorboard",
    "--timing-log",
    "--ckpt-",
    "--dist-ckpt-",
    "--async-save",
    "--use-persistent-ckpt-worker",
    "--distributed-backend",
    "--seed",
    "--exit-",
    "--wandb-",
    "--use-mcore-models",
    "--adam-beta",
    "--adam-eps",
    "--init-method-std",
    "--mock-data",
    "--manual-gc",
    "--deterministic-mode",
    "--no-ckpt-",
    "--auto-detect-ckpt-format",
    "--use-checkpoint-",
    "--finetune",
    "--no-load-",
    "--override-opt_param-scheduler",
    "--vocab-file",
    "--merge-file",
    "--num-workers",
    "--dataloader-",
    "--no-create-attention-mask",
    "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion",
    "--check-weight-hash-across-dp-replicas",
    "--bias-swiglu-fusion",
    "--no-bias-swiglu-fusion",
    "--bias-gelu-fusion",
    "--no-bias-gelu-fusion",
    "--bias-dropout-fusion",
    "--no-bias-dropout-fusion",
    "--use-mcore",
    "--full-validation",
    "--test-mode",
    "--use-tp-pp-dp-mapping",
    "--clip-grad",
    "--micro-batch-size",
)
#: the model's own flags: a training spec does not hold them (give the model with --model)
_MEGATRON_MODEL = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--max-position-embeddings",
    "--vocab-size",
    "--make-vocab-size-divisible-by",
    "--swiglu",
    "--normalization",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--group-query-attention",
    "--num-query-groups",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type",
    "--rotary-",
    "--hidden-dropout",
    "--attention-dropout",
    "--kv-channels",
    "--num-experts",
    "--moe-ffn-hidden-size",
    "--moe-router-topk",
    "--qk-layernorm",
    "--norm-epsilon",
    "--apply-layernorm-1p",
    "--no-position-embedding",
    "--use-rotary-position-embeddings",
    "--multi-latent-attention",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--moe-layer-freq",
    "--moe-shared-expert-",
    "--num-layers-per-virtual-pipeline-stage",
    "--seq-length",
    "--encoder-seq-length",
)
_MEGATRON_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-_]*$")


def model_config_args(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``--flag: value`` pairs of a Megatron-LM functional test's ``model_config.yaml``
    (``MODEL_ARGS``, with its ``ENV_VARS`` as ``ENV_VARS.NAME``); None for other YAML."""
    if not isinstance(data.get("MODEL_ARGS"), Mapping):
        return None
    args = {str(k): v for k, v in data["MODEL_ARGS"].items()}
    env = data.get("ENV_VARS")
    if isinstance(env, Mapping):
        args.update({f"ENV_VARS.{k}": v for k, v in env.items()})
    return args


def megatron_args(text: str, path: Path) -> dict[str, Any] | None:
    """The ``--flag value`` pairs of a Megatron-LM argument list: the words of a shell script
    or args file that calls ``pretrain_gpt.py``; None when the text has none of its flags."""
    if "--micro-batch-size" not in text and "--tensor-model-parallel-size" not in text:
        return None
    joined = re.sub(r"\\\n", " ", text)
    try:
        words = shlex.split(joined, comments=True)
    except ValueError as exc:
        raise InputFormatError(f"{path}: cannot split into arguments ({exc})") from None
    found: dict[str, Any] = {}
    for i, word in enumerate(words):
        if not _MEGATRON_FLAG.match(word.split("=")[0]):
            continue
        if "=" in word:
            name, value = word.split("=", 1)
            found[name] = value
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            found[word] = words[i + 1]
        else:
            found[word] = True
    return found


def from_megatron(args: Mapping[str, Any]) -> StackConfig:
    """Megatron-LM's ``pretrain_gpt.py`` arguments (``megatron/training/arguments.py``)."""
    keys = _Keys(dict(args))
    for key in list(args):
        if key.startswith(_MEGATRON_NO_MEMORY) or key.startswith(_MEGATRON_MODEL):
            keys.taken.add(key)
    for launcher in (
        "--nproc_per_node",
        "--nproc-per-node",
        "--nnodes",
        "--node_rank",
        "--node-rank",
        "--master_addr",
        "--master_port",
        "--master-addr",
        "--master-port",
        "--rdzv_endpoint",
        "--rdzv-endpoint",
        "--rdzv_backend",
    ):
        keys.taken.add(launcher)
    assumed: list[str] = []
    tp = keys.whole("--tensor-model-parallel-size", default=1, least=1)
    pp = keys.whole("--pipeline-model-parallel-size", default=1, least=1)
    cp = keys.whole("--context-parallel-size", default=1, least=1)
    ep = keys.whole("--expert-model-parallel-size", default=1, least=1)
    per_node = args.get("--nproc_per_node", args.get("--nproc-per-node"))
    nodes = args.get("--nnodes", 1)
    if per_node is not None and str(per_node).isdigit() and str(nodes).isdigit():
        world = int(per_node) * int(nodes)
    else:
        world = DEFAULT_NODE_GPUS
        assumed.append(
            f"{DEFAULT_NODE_GPUS} GPUs (the launch says the world size, not the arguments); say "
            "--set parallel.dp=N for N data-parallel ranks"
        )
    dp = max(1, world // (tp * pp * cp))
    micro = keys.whole("--micro-batch-size", default=1, least=1)
    global_batch = keys.get("--global-batch-size")
    accum = _int(global_batch, "--global-batch-size") // (micro * dp) if global_batch else 1
    parallel: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero_stage": 0}
    etp = keys.whole("--expert-tensor-parallel-size", default=tp, least=1)
    if ep * etp // tp != ep:
        # Megatron takes EP x ETP ranks of TP x DP for the experts; Headroom carves EP from DP
        # and splits every expert over TP: EP x ETP / TP gives the same experts' bytes a rank
        assumed.append(
            f"expert parallelism {ep} with expert TP {etp} as ep {max(1, ep * etp // tp)}"
        )
        ep = max(1, ep * etp // tp)
    if ep > 1:
        parallel["ep"] = ep
    parallel["sequence_parallel"] = bool(keys.get("--sequence-parallel", default=False))
    vpp = keys.get(
        "--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"
    )
    per_stage = args.get("--num-layers-per-virtual-pipeline-stage")
    layers = args.get("--num-layers")
    layout = keys.get("--pipeline-model-parallel-layout")
    if vpp is not None:
        parallel["vpp"] = _int(vpp, "--virtual-pipeline-model-parallel-size")
    elif isinstance(layout, str) and pp > 1:
        # Megatron's layout string: stages split by '|', '(...)*n' repeats a group
        # (megatron/core/transformer/pipeline_parallel_layer_layout.py)
        expanded = layout.replace("\\", "")
        while (group := re.search(r"\(([^()]*)\)\*(\d+)", expanded)) is not None:
            expanded = expanded.replace(group.group(0), group.group(1) * int(group.group(2)), 1)
        stages = expanded.count("|") + 1
        total = _int(layers, "--num-layers") if layers is not None else 0
        if stages % pp == 0 and stages > pp and total % stages == 0:
            parallel["vpp"] = stages // pp
        elif stages > pp:
            assumed.append(
                f"layout {layout}: {stages} virtual stages do not split {total} layers evenly, "
                "as the interleaved schedule's price needs; priced as 1F1B"
            )
    elif per_stage is not None and layers is not None:
        parallel["vpp"] = max(
            1,
            _int(layers, "--num-layers")
            // (pp * _int(per_stage, "--num-layers-per-virtual-pipeline-stage", least=1)),
        )
    train: dict[str, Any] = {
        "framework": "megatron",
        "activation_profile": "megatron",
        "micro_batch_size": micro,
        "grad_accum_steps": max(1, accum),
        "parallel": parallel,
        "optimizer": "adamw",
        "optimizer_impl": "fused",
    }
    seq = args.get("--seq-length", args.get("--encoder-seq-length"))
    if seq is not None:
        train["seq_len"] = _int(seq, "--seq-length")
    half = "bf16" if keys.get("--bf16") else "fp16" if keys.get("--fp16") else "fp32"
    train["precision"] = {
        "params": half,
        "grads": "fp32",
        "master": "fp32" if half != "fp32" else "none",
        "optimizer_states": "fp32",
    }
    optimizer = str(keys.get("--optimizer", default="adam"))
    if optimizer != "adam":
        train["optimizer"] = optimizer
    clip = _float(args.get("--clip-grad", 1.0), "--clip-grad")
    train["max_grad_norm"] = clip if clip > 0 else None
    train["megatron"] = {
        "use_distributed_optimizer": bool(keys.get("--use-distributed-optimizer", default=False)),
        "overlap_grad_reduce": bool(keys.get("--overlap-grad-reduce", default=False)),
        "overlap_param_gather": bool(keys.get("--overlap-param-gather", default=False)),
    }
    granularity = keys.get("--recompute-granularity")
    method = keys.get("--recompute-method")
    every = keys.whole("--recompute-num-layers", default=1, least=1)
    if keys.get("--recompute-activations") or granularity == "selective":
        modules = keys.get("--recompute-modules", default=["core_attn"])
        names = _names(modules)
        if "core_attn" in names:
            train["recompute"] = "selective"
        else:
            train["recompute"] = "none"
        if names != ["core_attn"]:
            # Headroom's selective recomputes the core attention; the other modules' recompute
            # (norms, up-projections, MLPs, activations) is not priced: their inputs are kept
            assumed.append(
                f"--recompute-modules {' '.join(names)}: only core_attn's recompute is priced"
            )
    elif granularity == "full":
        train["recompute"] = "full" if every == 1 else {"every_k": every}
        if method == "block":
            assumed.append(f"--recompute-method block ({every} layers a stage) priced as uniform")
    else:
        train["recompute"] = "none"
    keys.get("--cross-entropy-fusion-impl")
    if keys.get("--cross-entropy-loss-fusion"):
        train["loss"] = {"impl": "fused"}
    impl = keys.get("--transformer-impl", default="transformer_engine")
    backend = keys.get("--attention-backend", default="auto")
    flash = keys.get("--use-flash-attn", default=False)
    unfused = backend == "unfused" or (
        impl == "local" and not flash and backend in ("auto", "local")
    )
    train["attention"] = "eager" if unfused else "flash"
    alloc = str(keys.get("ENV_VARS.PYTORCH_CUDA_ALLOC_CONF", default=""))
    train["expandable_segments"] = "expandable_segments:True" in alloc.replace(" ", "")
    if args.get("--num-experts"):
        # the megatron profile was traced on dense layers and refuses MoE: its derived terms
        train["activation_profile"] = "textbook"
        assumed.append("MoE layers priced by the textbook profile (megatron's traces are dense)")
    hint = None
    if layers is not None and args.get("--hidden-size") is not None:
        hint = f"{layers} layers x {args['--hidden-size']}"
    return StackConfig("megatron", train, hint, keys.rest(), assumed)


# --- DeepSpeed (with HF TrainingArguments) -----------------------------------------------------

#: HF TrainingArguments keys (and LLaMA-Factory's, axolotl's, ms-swift's) that change nothing a
#: GPU holds, by prefix
_HF_NO_MEMORY = (
    "model_name_or_path",
    "output_dir",
    "logging",
    "save",
    "eval",
    "learning_rate",
    "lr_",
    "warmup",
    "num_train_epochs",
    "max_steps",
    "seed",
    "report_to",
    "run_name",
    "dataset",
    "template",
    "max_samples",
    "overwrite",
    "preprocessing_num_workers",
    "plot_loss",
    "ddp_timeout",
    "do_train",
    "do_eval",
    "val_size",
    "per_device_eval_batch_size",
    "weight_decay",
    "adam_",
    "hub_",
    "push_to_hub",
    "resume_from_checkpoint",
    "dataloader_",
    "stage",
    "trust_remote_code",
    "deepspeed",
    "base_model",
    "datasets",
    "wandb_",
    "val_set_size",
    "sequence_len",
    "cutoff_len",
    "micro_batch_size",
    # axolotl's: the tokenizer, the loader's checks, the schedule, what is logged or saved
    "tokenizer",
    "model_type",
    "strict",
    "train_on_inputs",
    "group_by_length",
    "tf32",
    "num_epochs",
    "lr_scheduler",
    "special_tokens",
    "evals_per_epoch",
    "saves_per_epoch",
    "early_stopping",
    "debug",
    "gradient_checkpointing_kwargs",
    # packing fills each sequence to sequence_len, the tokens the estimate prices
    "sample_packing",
    "pad_to_sequence_len",
    "flash_attention",
)
#: DeepSpeed config keys that change nothing a GPU holds
_DS_NO_MEMORY = (
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "train_batch_size",
    "fp16.loss_scale",
    "fp16.loss_scale_window",
    "fp16.initial_scale_power",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.allgather_partitions",
    "zero_optimization.reduce_scatter",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.allgather_bucket_size",
    "optimizer.params",
    "scheduler",
)


#: HF's ``optim`` (axolotl's ``optimizer``) as a training spec's optimizer and kernel: torch's
#: AdamW runs foreach on CUDA; bitsandbytes' 8-bit AdamW (paged or not) keeps 8-bit moments
_HF_OPTIM = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_hf": ("adamw", "for_loop"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_apex_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw_8bit", "fused"),
    "adamw_8bit": ("adamw_8bit", "fused"),
    "paged_adamw_8bit": ("adamw_8bit", "fused"),
    "adafactor": ("adafactor", "for_loop"),
    "sgd": ("sgd", "foreach"),
}
#: what trains a subset of the weights (an adapter, frozen layers) or a quantized base: not a
#: training spec's, which prices every weight trained in 16 or 32 bits
_PARTIAL = {
    "finetuning_type": "full",  # LLaMA-Factory: lora, freeze, oft train part of the model
    "adapter": None,  # axolotl: lora, qlora
    "load_in_8bit": False,
    "load_in_4bit": False,
}


def _hf_partial(args: _Keys) -> list[str]:
    """The keys that say only part of the model trains, or its base is quantized, named with
    what the estimate does instead (full fine-tuning: the larger)."""
    named = []
    for key, whole in _PARTIAL.items():
        found = args.get(key, default=whole)
        if found not in (whole, None, False, ""):
            named.append(
                f"{key}: {found} (only part of the model trains, or its base is quantized: "
                "priced as full fine-tuning, which holds more)"
            )
    return named


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """A DeepSpeed config has its ``zero_optimization`` or ``train_micro_batch_size_per_gpu``."""
    return "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data


def from_deepspeed(ds: Mapping[str, Any], hf: Mapping[str, Any] | None = None) -> StackConfig:
    """A DeepSpeed config, its ``"auto"`` values from the HF ``TrainingArguments`` beside it
    (a YAML or JSON of them: transformers', LLaMA-Factory's, axolotl's) where given."""
    keys = _Keys(dict(_flatten(ds)))
    keys.ignore(*_DS_NO_MEMORY)
    args = _Keys(dict(hf or {}))
    for key, given in args.flat.items():
        if key.startswith(_HF_NO_MEMORY) or given is None:  # a key set to nothing says nothing
            args.taken.add(key)
    assumed: list[str] = []

    def value(ds_key: str, *hf_keys: str, default: Any) -> Any:
        found = keys.get(ds_key, default="auto")
        if found != "auto":
            return found
        return args.get(*hf_keys, default=default) if hf_keys else default

    stage = keys.whole("zero_optimization.stage", default=0, least=0)
    train: dict[str, Any] = {
        "framework": "deepspeed" if stage else "none",
        "activation_profile": "hf",
        "optimizer": "adamw",
        "optimizer_impl": "foreach",  # HF's adamw_torch: torch's AdamW, foreach on CUDA
    }
    micro = value(
        "train_micro_batch_size_per_gpu",
        "per_device_train_batch_size",
        "micro_batch_size",
        default=8,
    )
    train["micro_batch_size"] = _int(micro, "train_micro_batch_size_per_gpu", least=1)
    accum = value("gradient_accumulation_steps", "gradient_accumulation_steps", default=1)
    train["grad_accum_steps"] = _int(accum, "gradient_accumulation_steps", least=1)
    seq_keys = ("cutoff_len", "sequence_len", "max_length", "max_seq_length", "block_size")
    seq = args.get(*seq_keys)
    if seq is not None:
        train["seq_len"] = _int(seq, args._named(seq_keys), least=1)
    clip = _float(value("gradient_clipping", "max_grad_norm", default=1.0), "gradient_clipping")
    train["max_grad_norm"] = clip if clip > 0 else None
    bf16 = value("bf16.enabled", "bf16", default=False)
    fp16 = value("fp16.enabled", "fp16", default=False)
    if bf16 == "auto":  # axolotl's: bf16 where the GPU has it
        bf16 = True
        assumed.append("bf16: auto as bf16 (a GPU with bf16: Ampere or newer)")
    half = "bf16" if bf16 is True else "fp16" if fp16 is True else None
    if half is None:
        train["precision"] = {
            "params": "fp32",
            "grads": "fp32",
            "master": "none",
            "optimizer_states": "fp32",
        }
    else:
        train["precision"] = {
            "params": half,
            "grads": half,
            "master": "fp32",
            "optimizer_states": "fp32",
        }
        if not ds:  # the Trainer's autocast keeps fp32 weights and gradients: as many bytes
            assumed.append(
                f"{half} autocast as 16-bit weights and gradients with fp32 master weights "
                "(the same 16 bytes of model state a parameter as fp32 weights, gradients and "
                "moments)"
            )
    checkpointing = args.get("gradient_checkpointing")
    if checkpointing is None and hf is not None and ("cutoff_len" in hf or "finetuning_type" in hf):
        checkpointing = not args.get("disable_gradient_checkpointing", default=False)
        assumed.append("LLaMA-Factory's default gradient checkpointing")
    train["recompute"] = "full" if checkpointing else "none"
    optim = args.get("optim", "optimizer")
    if isinstance(optim, str) and optim in _HF_OPTIM:
        train["optimizer"], train["optimizer_impl"] = _HF_OPTIM[optim]
        if optim.startswith("paged_"):
            assumed.append(f"{optim} as its moments on the GPU (paged out only under pressure)")
    elif optim is not None:
        args.taken.discard("optim")
        args.taken.discard("optimizer")
    if args.get("use_liger_kernel", default=False):
        train["loss"] = {"impl": "fused_linear"}
    train["parallel"] = {"dp": DEFAULT_NODE_GPUS, "zero_stage": stage}
    assumed.append(
        f"{DEFAULT_NODE_GPUS} GPUs (the launch says the world size); say --set parallel.dp=N"
    )
    knobs: dict[str, Any] = {}
    auto: list[str] = []
    for name in (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "sub_group_size",
    ):
        found = keys.get(f"zero_optimization.{name}")
        if found is None:
            continue
        if found == "auto":
            auto.append(name)
            assumed.append(
                f"zero_optimization.{name} auto (HF sizes it from the model's hidden "
                "width) as DeepSpeed's default"
            )
            continue
        knobs[name] = int(_float(found, f"zero_optimization.{name}"))
    overlap = keys.get("zero_optimization.overlap_comm")
    if isinstance(overlap, bool):
        knobs["overlap_comm"] = overlap
    if knobs:
        train["deepspeed"] = knobs
    device = keys.get("zero_optimization.offload_optimizer.device", default="none")
    ratio = keys.get("zero_optimization.offload_optimizer.ratio", default=1)
    if device == "cpu":
        ratio_key = "zero_optimization.offload_optimizer.ratio"
        train["offload"] = {"mode": "optimizer", "fraction": _float(ratio, ratio_key)}
    unmapped = _hf_partial(args)
    if keys.get("zero_optimization.offload_param.device", default="none") not in ("none", None):
        unmapped.append("zero_optimization.offload_param (parameter offload: not priced)")
    for key in ("fsdp", "fsdp_config"):
        if args.get(key) not in (None, "", [], {}):
            unmapped.append(
                f"{key} (FSDP through accelerate: priced as data parallelism, every rank "
                "holding every weight; for FSDP2 write a training spec with framework fsdp2)"
            )
    rest = unmapped + keys.rest() + args.rest()
    return StackConfig("deepspeed" if ds else "hf", train, None, rest, assumed, auto)


def is_hf_args(data: Mapping[str, Any]) -> bool:
    """HF ``TrainingArguments`` of a run without DeepSpeed: axolotl's YAML (``base_model`` and
    its batch or sequence length), or LLaMA-Factory's and transformers' own (a per-device batch
    and the model or the output folder)."""
    if "base_model" in data and ("micro_batch_size" in data or "sequence_len" in data):
        return True
    return "per_device_train_batch_size" in data and (
        "model_name_or_path" in data or "output_dir" in data
    )


def _read_data(path: Path, text: str) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except (ValueError, RecursionError):  # not JSON, past int's digits, nested too deep
            return None
    try:
        return importlib.import_module("yaml").safe_load(text)
    except Exception:  # no PyYAML, or not YAML (nested too deep too): read_file says which
        return None


def _beside(path: Path, named: str) -> Path | None:
    """The file ``named`` (as a YAML names its DeepSpeed config) beside ``path`` or above it."""
    candidate = Path(named)
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    for folder in (path.parent, *path.parent.parents):
        if (folder / candidate).is_file():
            return folder / candidate
        if (folder / candidate.name).is_file():
            return folder / candidate.name
    return None


#: how a file a config names (the DeepSpeed JSON an HF ``TrainingArguments`` YAML names) is
#: found: from the naming file's path and the name, its path and text, or None
Finder = Callable[[Path, str], "tuple[Path, str] | None"]


def _on_disk(path: Path, named: str) -> tuple[Path, str] | None:
    found = _beside(path, named)
    if found is None:
        return None
    try:
        return found, found.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFormatError(f"{found}: cannot read file ({exc})") from None


# --- recognising a file -----------------------------------------------------------------------


def recognise(path: Path, text: str, find: Finder = _on_disk) -> StackConfig | None:
    """The stack config ``text`` (read from ``path``) is, mapped; None if it is none of them.
    A file it names is looked up by ``find`` (default: beside it on disk, or above)."""
    if path.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InputFormatError(f"{path}: not valid TOML ({exc})") from None
        except RecursionError:
            raise InputFormatError(f"{path}: not valid TOML (nested too deeply)") from None
        if is_torchtitan(data):
            return from_torchtitan(data)
        raise InputFormatError(
            f"{path}: a TOML training config is read as torchtitan's job config, which has a "
            "[training] table and a [parallelism] or [model] table"
        )
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    if not yaml_file:
        args = megatron_args(text, path)
        if args is not None:
            return from_megatron(args)
    data = _read_data(path, text)  # parsed once: a functional test's YAML, DeepSpeed, HF args
    if yaml_file and isinstance(data, Mapping):
        args = model_config_args(data)
        if args is not None:
            return from_megatron(args)
    if isinstance(data, Mapping) and is_deepspeed(data):
        return from_deepspeed(data)
    if isinstance(data, Mapping) and isinstance(data.get("deepspeed"), str):
        found = find(path, data["deepspeed"])
        if found is None:
            raise InputFormatError(
                f"{path}: deepspeed: {data['deepspeed']} is not beside it or above it"
            )
        named, named_text = found
        ds = _read_data(named, named_text)
        if not isinstance(ds, Mapping) or not is_deepspeed(ds):
            raise InputFormatError(f"{named}: not a DeepSpeed config (no zero_optimization)")
        return from_deepspeed(ds, data)
    if isinstance(data, Mapping) and is_hf_args(data):
        return from_deepspeed({}, data)  # data parallelism: no ZeRO stage
    return None


#: what a stack config sent as text may be (``from_texts``)
KINDS_TEXT = (
    "a torchtitan job TOML, a Megatron-LM argument list (pretrain_gpt.py flags, or a functional "
    "test's model_config.yaml), a DeepSpeed config JSON, or HF TrainingArguments as YAML or "
    "JSON (transformers', LLaMA-Factory's, axolotl's), with the DeepSpeed config it names sent "
    "beside it"
)


def _has_aliases(text: str) -> bool:
    """Whether YAML ``text`` uses an alias (``*name``): one line of them expands to more
    values than memory holds, where a stack's config has no use for them."""
    try:
        yaml = importlib.import_module("yaml")
        return any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text))
    except Exception:  # no PyYAML, or not YAML: nothing to expand
        return False


def from_texts(files: Sequence[tuple[str, str]]) -> StackConfig:
    """The stack config of files sent by name and text (a request's, never the disk's): the
    first is the config, the others what it names (the DeepSpeed JSON an HF YAML names), found
    by their base name. An ``InputFormatError`` names the file that is not one of
    :data:`KINDS_TEXT` or uses a YAML alias."""
    if not files:
        raise InputFormatError("no file: send the stack's config, then the files it names")
    named = {Path(name).name: (Path(Path(name).name), text) for name, text in files}
    for name, (path, text) in named.items():
        if path.suffix.lower() not in (".json", ".toml") and _has_aliases(text):
            raise InputFormatError(f"{name}: a YAML alias (*name) is not read in a stack config")

    def find(_path: Path, wanted: str) -> tuple[Path, str] | None:
        return named.get(Path(wanted).name)

    first, text = files[0]
    path = Path(Path(first).name)
    stack = recognise(path, text, find)
    if stack is None:
        raise InputFormatError(f"{path}: not a stack's training config; one is {KINDS_TEXT}")
    return stack


__all__ = [
    "StackConfig",
    "from_deepspeed",
    "from_megatron",
    "from_texts",
    "from_torchtitan",
    "is_hf_args",
    "is_torchtitan",
    "megatron_args",
    "model_config_args",
    "recognise",
]
