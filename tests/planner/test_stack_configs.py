"""A stack's own training config as a training spec (``planner.stack_configs``): each reader
is held to the published runs' own config files (``tests/data/stack-configs``, each read from
its repository at the commit its run's source names: ``MANIFEST.json``), which must map to the
training spec ``calibration/data/published-memory.json`` holds for that run.

What a file cannot say is given as the run gave it, and nothing else:
- ``launch``: the run's command-line overrides of the file's keys (torchtitan's
  ``--training.batch_size 2`` and the like), from the run's source;
- ``release``: what the stack's release decided where the file names nothing (its FSDP
  grouping, whether ``training.compile`` compiled the loss, the launcher's allocator setting),
  which the reader says it assumed and the user overrides with ``--set``;
- the data-parallel degree, which the launch sets (``--set parallel.dp``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from headroom import planner
from headroom.calibration import published
from headroom.cli import app
from headroom.planner.io import apply_overrides
from headroom.planner.stack_configs import (
    StackConfig,
    from_deepspeed,
    from_megatron,
    from_torchtitan,
    megatron_args,
    recognise,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "stack-configs"
MANIFEST = json.loads((DATA / "MANIFEST.json").read_text())
RUNS = {run["id"]: run for run in published.runs()}

#: torchtitan before #1094 (2025-07-28) grouped the embedding, norm and head with the root
ROOT = {"fsdp2.groups": "root"}
#: and before bbb1b616 (2025-04-02) training.compile left the loss eager
EAGER_LOSS = {"loss.compiled": False}
#: a launch that bypasses run_train.sh sets no allocator configuration
NO_EXPANDABLE = {"expandable_segments": False}
#: and its 2024 releases had optimizer.fused, off by default: foreach AdamW
FOREACH = {"optimizer_impl": "foreach"}
#: the 9dec370 (2024-12) benchmark runs: all three
DEC_2024 = {**ROOT, **EAGER_LOSS, **FOREACH}
#: torchao's March 2025 runs (torchtitan 0.0.2): optimizer.implementation, fused by default
MAR_2025 = {**ROOT, **EAGER_LOSS}

#: run -> (launch overrides of the file's keys, release knobs), from each run's source
TORCHTITAN: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # torchao's llama3.sh: --training.local-batch-size=1 --training.compile
    "torchao_l3_8b_bf16_fsdp8_b200": (
        {"training.local_batch_size": 1, "training.compile": True},
        {},
    ),
    "torchao_l3_8b_bf16_fsdp8_mi300x": (
        {"training.local_batch_size": 1, "training.compile": True},
        {},
    ),
    # float8_training_benchmark.sh: --training.batch_size=1 --training.compile (torchtitan 0.0.2)
    "torchao_l3_8b_bf16_fsdp8_h100": (
        {"training.batch_size": 1, "training.compile": True},
        MAR_2025,
    ),
    "torchao_l3_8b_fp8_tensorwise_fsdp8_h100": (
        {"training.batch_size": 1, "training.compile": True, "model.converters": ["float8"]},
        MAR_2025,
    ),
    # issue #620: the stock config on two GPUs, launched without run_train.sh's allocator setting
    "tt_issue620_l3_8b_fsdp2_2x_rtx6000ada_oom": ({}, {**ROOT, **FOREACH, **NO_EXPANDABLE}),
    # docs/performance.md: 1D FSDP with selective per-op checkpointing at local batch 2
    "tt_l2_70b_fsdp64_lbs2_sac_oom_a100": (
        {
            "training.batch_size": 2,
            "training.tensor_parallel_degree": 1,
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "op",
        },
        {**ROOT, **FOREACH, **NO_EXPANDABLE},
    ),
    # issue: the 405B tried 1D on 128 GPUs
    "tt_l31_405b_fsdp128_1d_oom_h100": (
        {"training.tensor_parallel_degree": 1},
        {**DEC_2024, **NO_EXPANDABLE},
    ),
    # benchmarks/llama3_h100_202412_torchtitan.md at 9dec370: each table's caption
    "tt_l31_8b_fsdp8_eager_h100": ({"training.batch_size": 2}, DEC_2024),
    "tt_l31_8b_fsdp128_eager_h100": ({"training.batch_size": 2}, DEC_2024),
    "tt_l31_8b_fsdp8_compile_h100": (
        {"training.batch_size": 2, "training.compile": True},
        DEC_2024,
    ),
    "tt_l31_8b_fsdp128_compile_h100": (
        {"training.batch_size": 2, "training.compile": True},
        DEC_2024,
    ),
    "tt_l31_8b_fsdp8_compile_fp8_h100": (
        {"training.batch_size": 2, "training.compile": True, "model.converters": ["float8"]},
        DEC_2024,
    ),
    "tt_l31_8b_fsdp8_cp1_32k_fp8_h100": (
        {
            "training.batch_size": 1,
            "training.seq_len": 32768,
            "activation_checkpoint.mode": "full",
            "training.compile": True,
            "model.converters": ["float8"],
        },
        DEC_2024,
    ),
    "tt_l31_8b_fsdp4_cp2_64k_fp8_h100": (
        {
            "training.batch_size": 1,
            "training.seq_len": 65536,
            "experimental.context_parallel_degree": 2,
            "activation_checkpoint.mode": "full",
            "training.compile": True,
            "model.converters": ["float8"],
        },
        DEC_2024,
    ),
    "tt_l31_70b_fsdp32_tp8_compile_fp8_h100": (
        {"training.batch_size": 16, "training.compile": True},
        DEC_2024,
    ),
    "tt_l31_70b_fsdp32_tp8_asynctp_fp8_h100": (
        {"training.batch_size": 16, "training.compile": True},
        DEC_2024,
    ),
    "tt_l31_405b_fsdp8_tp8_pp8_1f1b_h100": (
        {"training.batch_size": 32, "experimental.pipeline_parallel_degree": 8},
        DEC_2024,
    ),
    "tt_l31_405b_fsdp8_tp8_pp8_interleaved_h100": (
        {
            "training.batch_size": 32,
            "experimental.pipeline_parallel_degree": 8,
            "experimental.pipeline_parallel_schedule": "Interleaved1F1B",
        },
        DEC_2024,
    ),
    "tt_l31_405b_4d_fsdp8_cp1_32k_h100": (
        {
            "training.batch_size": 8,
            "training.seq_len": 32768,
            "experimental.pipeline_parallel_degree": 8,
        },
        DEC_2024,
    ),
    "tt_l31_405b_4d_fsdp1_cp8_256k_h100": (
        {
            "training.batch_size": 8,
            "training.seq_len": 262144,
            "experimental.pipeline_parallel_degree": 8,
            "experimental.context_parallel_degree": 8,
        },
        DEC_2024,
    ),
    # PR #1884's log: full checkpointing and CP 2 on 4 GPUs
    "tt_pr1884_l3_8b_flexattn_fsdp2_cp2_4gpu_h100": (
        {"parallelism.context_parallel_degree": 2, "activation_checkpoint.mode": "full"},
        {},
    ),
    # Trainy's published torchrun command (not run_train.sh): local batch 2, compile
    "tt_trainy_l31_8b_fsdp32_compile_fp8_h200": (
        {"training.local_batch_size": 2, "training.compile": True, "model.converters": ["float8"]},
        {**ROOT, **NO_EXPANDABLE},
    ),
    "tt_trainy_l31_8b_fsdp64_compile_fp8_h200": (
        {"training.local_batch_size": 2, "training.compile": True, "model.converters": ["float8"]},
        {**ROOT, **NO_EXPANDABLE},
    ),
    # an MoE model: the torchtitan profile's traces are dense, so the published spec prices it
    # with the hf profile's MoE terms and selective recompute, its compiled loss left eager
    "tt_dsv3_16b_fsdp8_ep8_lbs8_oom_h100": (
        {},
        {"activation_profile": "hf", "recompute": "selective", "loss.compiled": False},
    ),
}


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for key in path:
        data = data.setdefault(key, {})
    data[last] = value


def _spec(train: dict[str, Any], dp: int, release: dict[str, Any]) -> dict[str, Any]:
    assignments = [f"parallel.dp={dp}"] + [
        f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in release.items()
    ]
    spec = planner.load_train(apply_overrides(train, assignments))
    return spec.model_dump(mode="json")


def _files(suffix: str) -> list[dict[str, Any]]:
    return [m for m in MANIFEST if m["file"].endswith(suffix) and m["runs"]]


@pytest.mark.parametrize("entry", _files(".toml"), ids=lambda m: m["file"].split("/")[0])
def test_torchtitan_tomls_map_to_their_published_runs_specs(entry: dict[str, Any]) -> None:
    text = (DATA / entry["file"]).read_text()
    stock = recognise(DATA / entry["file"], text)
    assert stock is not None and stock.kind == "torchtitan"
    for run_id in entry["runs"]:
        launch, release = TORCHTITAN[run_id]
        data = tomllib.loads(text)
        for key, value in launch.items():
            _set(data, key, value)
        mapped = from_torchtitan(data)
        want = planner.load_train(RUNS[run_id]["spec"]["train"]).model_dump(mode="json")
        got = _spec(mapped.train, want["parallel"]["dp"], release)
        assert got == want, run_id


@pytest.mark.parametrize(
    "entry", _files("model_config.yaml"), ids=lambda m: m["file"].split("/")[0]
)
def test_megatron_functional_tests_map_to_their_published_runs_specs(
    entry: dict[str, Any],
) -> None:
    path = DATA / entry["file"]
    mapped = recognise(path, path.read_text())
    assert mapped is not None and mapped.kind == "megatron"
    # NVIDIA's CI runs each functional test on one node of 8 GPUs (tests/test_utils/recipes)
    assert any("8 GPUs" in a for a in mapped.assumed)
    (run_id,) = entry["runs"]
    want = planner.load_train(RUNS[run_id]["spec"]["train"]).model_dump(mode="json")
    assert planner.load_train(mapped.train).model_dump(mode="json") == want


def test_what_a_file_cannot_say_is_named_in_one_line() -> None:
    path = DATA / "tt_9dec370_202412" / "llama3_405b.toml"
    mapped = recognise(path, path.read_text())
    assert isinstance(mapped, StackConfig)
    line = mapped.warning("llama3_405b.toml")
    assert line is not None and "\n" not in line
    assert "float8 training (float8.enable_float8_linear; not priced" in line
    assert "data_parallel_shard_degree -1" in line and "--set parallel.dp=N" in line
    # what does not change memory (logging, checkpoints, the learning rate) is not listed
    assert "metrics." not in line and "checkpoint." not in line and "optimizer.lr" not in line


def test_a_megatron_shell_script_is_read_from_its_words(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_llama.sh"
    script.write_text(
        "#!/bin/bash\n"
        "GPUS_PER_NODE=8\n"
        "torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\\n"
        "    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \\\n"
        "    --sequence-parallel --use-distributed-optimizer \\\n"
        "    --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 \\\n"
        "    --num-layers 32 --hidden-size 4096 --bf16 \\\n"
        "    --recompute-granularity full --recompute-method uniform --recompute-num-layers 2 \\\n"
        "    --use-flash-attn --fp8-format hybrid  # fp8 is not priced\n"
    )
    args = megatron_args(script.read_text(), script)
    assert args is not None
    mapped = from_megatron(args)
    spec = planner.load_train(mapped.train)
    assert (spec.parallel.dp, spec.parallel.tp, spec.parallel.pp) == (2, 4, 2)  # 16 GPUs
    assert spec.grad_accum_steps == 32 and spec.seq_len == 4096
    assert spec.recompute == planner.train.Recompute(every_k=2)
    assert spec.megatron.use_distributed_optimizer and spec.parallel.sequence_parallel
    assert mapped.unmapped == ["--fp8-format"] and mapped.assumed == []


def test_gate_takes_a_torchtitan_toml_in_one_line(tmp_path: Path) -> None:
    toml = DATA / "torchao_l3_8b_bf16_fsdp8_b200" / "llama3_8b.toml"
    result = CliRunner().invoke(
        app, ["gate", "llama-3-8b", "--train", str(toml), "--gpu", "H100-80GB"]
    )
    assert result.exit_code == 0, result.output
    assert "fits" in result.stdout
    assert "warning: " in result.stderr and "torchtitan config" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nseq_len = \n")
    refused = CliRunner().invoke(app, ["gate", "llama-3-8b", "--train", str(bad)])
    assert refused.exit_code == 2 and "not valid TOML" in refused.output
    other = tmp_path / "pyproject.toml"
    other.write_text("[project]\nname = 'x'\n")
    refused = CliRunner().invoke(app, ["gate", "llama-3-8b", "--train", str(other)])
    assert refused.exit_code == 2 and "torchtitan's job config" in refused.output


#: LLaMA-Factory issue #5977: "fp16: true" where its example YAML says bf16; the fitting run
#: swapped the YAML's DeepSpeed config for the offloading one
LLAMA_FACTORY = {
    "llamafactory_l3_8b_full_zero3_8x3090_oom": "ds_z3_config.json",
    "llamafactory_l3_8b_full_zero3_offload_8x3090_fit": "ds_z3_offload_config.json",
}


@pytest.mark.parametrize("run_id", sorted(LLAMA_FACTORY))
def test_a_llama_factory_yaml_and_its_deepspeed_config_map_to_the_published_spec(
    run_id: str, tmp_path: Path
) -> None:
    folder = DATA / "llamafactory_issue5977_l3_8b_8x3090"
    data = (folder / "llama3_full_sft_ds3.yaml").read_text()
    data = data.replace("bf16: true", "fp16: true")
    data = data.replace("examples/deepspeed/ds_z3_config.json", LLAMA_FACTORY[run_id])
    yaml_file = tmp_path / "llama3_full_sft_ds3.yaml"
    yaml_file.write_text(data)
    (tmp_path / LLAMA_FACTORY[run_id]).write_bytes((folder / LLAMA_FACTORY[run_id]).read_bytes())
    mapped = recognise(yaml_file, data)
    assert mapped is not None and mapped.kind == "deepspeed"
    assert "auto" in " ".join(mapped.assumed)  # sized from the model: not yet
    model = planner.load_model("llama-3-8b")
    sized = mapped.with_model(model.hidden_size)
    want = planner.load_train(RUNS[run_id]["spec"]["train"]).model_dump(mode="json")
    assert planner.load_train(sized.train).model_dump(mode="json") == want
    if "offload" in run_id:
        assert any("offload_param" in u for u in sized.unmapped)


def test_an_ms_swift_deepspeed_config_with_its_cli_flags_maps_to_the_published_spec() -> None:
    ds = json.loads((DATA / "swift_q25_14b_zero2_a800" / "zero2.json").read_text())
    # examples/train/megatron/benchmark/deepspeed.sh at 8d95f8c9: --torch_dtype bfloat16
    # --per_device_train_batch_size 1 --gradient_accumulation_steps 2 --max_length 8192
    # (ms-swift's gradient_checkpointing defaults to true)
    flags = {
        "bf16": True,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "max_length": 8192,
        "gradient_checkpointing": True,
    }
    mapped = from_deepspeed(ds, flags)
    want = planner.load_train(RUNS["swift_q25_14b_zero2_a800"]["spec"]["train"])
    assert planner.load_train(mapped.train).model_dump(mode="json") == want.model_dump(mode="json")


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        (
            "a.toml",
            '[training]\nlocal_batch_size = "x"\n[parallelism]\n',
            "training.local_batch_size: expected a whole number, got 'x'",
        ),
        (
            "b.toml",
            "[training]\nlocal_batch_size = 1\n[parallelism]\ntensor_parallel_degree = 0\n",
            "parallelism.tensor_parallel_degree: expected a whole number of at least 1, got 0",
        ),
        (
            "ds.json",
            '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}',
            "zero_optimization.reduce_bucket_size: expected a number, got 'lots'",
        ),
        (
            "ds2.json",
            '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 0}',
            "train_micro_batch_size_per_gpu: expected a whole number of at least 1, got 0",
        ),
        (
            "run.sh",
            "pretrain_gpt.py --micro-batch-size 1 --tensor-model-parallel-size 0\n",
            "--tensor-model-parallel-size: expected a whole number of at least 1, got '0'",
        ),
        (
            "run2.sh",
            "pretrain_gpt.py --micro-batch-size 1 --clip-grad nan\n",
            "--clip-grad: expected a finite number, got 'nan'",
        ),
    ],
    ids=["toml-text", "toml-zero", "ds-text", "ds-zero", "megatron-zero", "megatron-nan"],
)
def test_a_bad_value_in_a_stacks_config_is_one_error_line_naming_its_key(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    result = CliRunner().invoke(app, ["estimate", "llama-3-8b", "--train", str(path)])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_an_axolotl_yaml_without_deepspeed_is_data_parallel_key_by_key() -> None:
    """axolotl's Llama 3 8B full fine-tuning example (MANIFEST.json): its keys as its trainer
    reads them; what it leaves to the GPU or the launch said, and nothing else."""
    path = DATA / "axolotl_llama3" / "fft-8b.yaml"
    mapped = recognise(path, path.read_text())
    assert mapped is not None and mapped.kind == "hf"
    assert mapped.train == {
        "framework": "none",
        "activation_profile": "hf",
        "optimizer": "adamw_8bit",  # paged_adamw_8bit: bitsandbytes' 8-bit moments
        "optimizer_impl": "fused",
        "micro_batch_size": 1,
        "grad_accum_steps": 8,
        "seq_len": 8192,  # sequence_len, packed to it (sample_packing, pad_to_sequence_len)
        "max_grad_norm": 1.0,
        "precision": {
            "params": "bf16",
            "grads": "bf16",
            "master": "fp32",
            "optimizer_states": "fp32",
        },
        "recompute": "full",  # gradient_checkpointing
        "parallel": {"dp": 8, "zero_stage": 0},
    }
    assert mapped.unmapped == []  # the keys set to nothing (deepspeed:, fsdp:) say nothing
    said = "; ".join(mapped.assumed)
    assert "bf16: auto as bf16" in said and "paged_adamw_8bit" in said and "8 GPUs" in said
    planner.load_train(mapped.train)  # a valid training spec


def test_what_trains_part_of_a_model_is_named_never_priced_in_silence() -> None:
    """axolotl's LoRA example on an 8-bit base, and LLaMA-Factory's finetuning_type: the
    estimate prices full fine-tuning, and the warning line says so."""
    path = DATA / "axolotl_llama3" / "lora-8b.yml"
    mapped = recognise(path, path.read_text())
    assert mapped is not None and mapped.train["optimizer"] == "adamw_8bit"  # adamw_bnb_8bit
    line = mapped.warning("lora-8b.yml") or ""
    assert "adapter: lora (only part of the model trains" in line
    assert "load_in_8bit: True" in line and "lora_r" in line
    llama_factory = {"finetuning_type": "lora", "per_device_train_batch_size": 1}
    assert any(
        u.startswith("finetuning_type: lora") for u in from_deepspeed({}, llama_factory).unmapped
    )
    full = from_deepspeed({}, {**llama_factory, "finetuning_type": "full"})
    assert not any("finetuning_type" in u for u in full.unmapped)


@pytest.mark.parametrize(
    ("optim", "optimizer", "impl"),
    [
        ("adamw_torch", "adamw", "foreach"),
        ("adamw_torch_fused", "adamw", "fused"),
        ("adamw_bnb_8bit", "adamw_8bit", "fused"),
        ("adafactor", "adafactor", "for_loop"),
        ("lion_32bit", "adamw", "foreach"),  # none of the spec's: named, the default kept
    ],
)
def test_hf_optim_is_the_specs_optimizer_or_named(optim: str, optimizer: str, impl: str) -> None:
    mapped = from_deepspeed({"zero_optimization": {"stage": 2}}, {"optim": optim})
    assert (mapped.train["optimizer"], mapped.train["optimizer_impl"]) == (optimizer, impl)
    assert ("optim" in mapped.unmapped) == (optim == "lion_32bit")


def test_a_transformers_training_arguments_json_is_read_as_data_parallel(tmp_path: Path) -> None:
    args = {
        "output_dir": "out",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "bf16": True,
        "gradient_checkpointing": True,
        "optim": "adamw_torch_fused",
        "fsdp": "full_shard auto_wrap",
    }
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(args))
    mapped = recognise(path, path.read_text())
    assert mapped is not None and mapped.kind == "hf"
    assert mapped.train["micro_batch_size"] == 4 and mapped.train["optimizer_impl"] == "fused"
    # FSDP through accelerate is not data parallelism: named, with what to write instead
    assert any(u.startswith("fsdp (FSDP through accelerate") for u in mapped.unmapped)
    assert "bf16 autocast" in "; ".join(mapped.assumed)
