"""The ``headroom estimate`` / ``presets`` contract, through a real subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from headroom_process import run_headroom, run_wide

from headroom import planner

HF = Path(planner.__file__).parent / "data" / "hf"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_headroom(*args, timeout=120)


def test_estimate_json_contract(tmp_path: Path) -> None:
    train = tmp_path / "train.yaml"
    train.write_text(
        "micro_batch_size: 2\nseq_len: 2048\nrecompute: full\n"
        "offload: {mode: optimizer, fraction: 0.5}\n"
    )
    proc = run(
        "estimate",
        "llama-3-8b",
        "--train",
        str(train),
        "--gpu",
        "H100-80GB",
        "--host-memory",
        "1.5TiB",
        "--format",
        "json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["gpu"]["buckets"]) == set(planner.GPU_BUCKETS)
    assert set(out["host"]["buckets"]) == set(planner.HOST_BUCKETS)
    for key in ("peak_bytes", "capacity_bytes"):
        assert isinstance(out["gpu"][key], int)
    # the peak three ways, as a run reports it: allocated, reserved, what nvidia-smi shows
    gpu = out["gpu"]
    assert gpu["reserved_peak_bytes"] == gpu["peak_bytes"] - gpu["buckets"]["cuda_context"]
    assert gpu["allocated_peak_bytes"] == (
        gpu["reserved_peak_bytes"] - gpu["buckets"]["allocator_overhead"]
    )
    assert gpu["allocated_peak_bytes"] == sum(gpu["buckets"][b] for b in planner.GPU_BUCKETS[:9])
    assert out["host"]["capacity_bytes"] == int(1.5 * 2**40)
    assert isinstance(out["host"]["peak_bytes"], int)
    assert out["peak_phase"] in planner.PHASES
    assert isinstance(out["fits"], bool)
    # the same numbers as the Python API
    spec = planner.TrainSpec(
        micro_batch_size=2,
        seq_len=2048,
        recompute="full",
        offload={"mode": "optimizer", "fraction": 0.5},
    )
    hw = planner.gpu("H100-80GB").model_copy(update={"host_memory_bytes": int(1.5 * 2**40)})
    budget = planner.estimate(planner.load_model("llama-3-8b"), spec, hw)
    assert out == json.loads(budget.model_dump_json())


def test_estimate_reads_hf_config_file_and_set_overrides() -> None:
    proc = run(
        "estimate",
        str(HF / "mixtral-8x7b.json"),
        "--gpu",
        "h200",
        "--set",
        "parallel.dp=8",
        "--set",
        "parallel.ep=8",
        "--set",
        "parallel.zero_stage=1",
        "--set",
        "recompute=full",
        "--format",
        "json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"]["params_total"] == 46_702_792_704
    assert out["gpu"]["buckets"]["moe_dispatch"] >= 0
    assert out["gpu"]["name"] == "H200-141GB"


def test_estimate_takes_the_losss_implementation() -> None:
    """``--set loss.impl=chunked`` (torchtune's chunked cross entropy) holds 4 bytes a logit
    through forward where the textbook's standard loss holds 6, and the explanation says
    where the terms come from."""
    standard = json.loads(run("estimate", "llama-3-8b", "--format", "json").stdout)
    proc = run(
        "estimate", "llama-3-8b", "--set", "loss.impl=chunked", "--explain", "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    chunked = json.loads(proc.stdout)
    logits = 4096 * 128256
    assert standard["gpu"]["phases"]["forward"]["buckets"]["logits"] == 6 * logits
    assert chunked["gpu"]["phases"]["forward"]["buckets"]["logits"] == 4 * logits
    assert chunked["explain"]["logits"]["inputs"]["loss_impl"] == "chunked"
    assert chunked["explain"]["logits"]["source"] == "planner/losses.py"


def test_estimate_text_and_explain() -> None:
    proc = run("estimate", "qwen1.5-moe-a2.7b", "--gpu", "A100-80GB", "--explain")
    assert proc.returncode == 0, proc.stderr
    for word in ("moe_dispatch", "allocator_overhead", "Korthikanti", "B·T·E·4"):
        assert word in proc.stdout.replace("\n", " ") or word in proc.stdout


def test_a_pipelined_estimate_names_each_end_stages_peak() -> None:
    """Under pipeline parallelism the text names the first and the last stage's peak, each as
    allocated, reserved and whole-GPU bytes (a run's log may be one rank's: Megatron-LM logs
    the last stage's), the same numbers as ``stage_peaks``; without it, no stage line."""
    from headroom.planner.estimator import stage_peaks
    from headroom.planner.units import format_bytes

    args = ("--gpu", "H100-80GB", "--set", "parallel.pp=4", "--set", "grad_accum_steps=8")
    proc = run("estimate", "llama-3-8b", *args)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    train = planner.TrainSpec.model_validate({"parallel": {"pp": 4}, "grad_accum_steps": 8})
    peaks = stage_peaks(planner.load_model("llama-3-8b"), train, planner.gpu("H100-80GB"))
    assert [p.stage for p in peaks] == [0, 3]
    for p in peaks:
        line = (
            f"pipeline stage {p.stage}: {format_bytes(p.peak_bytes)} in {p.phase} (allocated "
            f"{format_bytes(p.allocated_bytes)}, reserved {format_bytes(p.reserved_bytes)})"
        )
        assert line in text
    single = run("estimate", "llama-3-8b", "--gpu", "H100-80GB")
    assert "pipeline stage" not in single.stdout


def test_explain_json_names_formula_inputs_source() -> None:
    proc = run("estimate", "llama-3-8b", "--explain", "--format", "json")
    out = json.loads(proc.stdout)
    assert set(out["explain"]) == set(planner.GPU_BUCKETS)
    for entry in out["explain"].values():
        assert entry["formula"] and entry["source"] and isinstance(entry["inputs"], dict)
        assert entry["bytes"] == out["gpu"]["buckets"][entry["bucket"]]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "no-such-model"], "model: 'no-such-model' is neither a file nor a preset"),
        (["estimate", "llama-3-8b", "--gpu", "B999"], "gpu: unknown preset 'B999'; allowed:"),
        (
            ["estimate", "llama-3-8b", "--set", "micro_batch_size=0"],
            "train.micro_batch_size: Input should be greater than or equal to 1",
        ),
        (
            ["estimate", "llama-3-8b", "--set", "recompute=sometimes"],
            "train.recompute: must be 'none', 'selective', 'selective_op', 'full' or "
            '{"every_k": K}',
        ),
        (["estimate", "llama-3-8b", "--set", "optimizer=lion"], "train.optimizer: Input should be"),
        (
            ["estimate", "llama-3-8b", "--set", "parallel.dp=3", "--set", "parallel.ep=2"],
            "parallel.ep must divide parallel.dp x parallel.cp (3), got 2",
        ),
        (
            ["estimate", "llama-3-8b", "--set", "offload.mode=streaming", "--set", "parallel.tp=2"],
            "offload.mode: streaming runs one layer stream per GPU",
        ),
        (["estimate", "llama-3-8b", "--host-memory", "lots"], "--host-memory: cannot read 'lots'"),
        (["estimate", "llama-3-8b", "--set", "unknown_key=1"], "train.unknown_key: unknown field"),
        (
            ["estimate", "llama-3-8b", "--set", "loss.impl=liger"],
            "train.loss.impl: Input should be 'standard', 'chunked', 'chunked_linear', 'fused', "
            "'fused_linear' or 'cut'",
        ),
        (
            ["estimate", "llama-3-8b", "--set", "loss.impl=cut", "--set", "parallel.tp=2"],
            "loss.impl: cut is priced on a whole vocabulary",
        ),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args: list[str], needle: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_files_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "model.json"
    broken.write_text("{not json")
    proc = run("estimate", str(broken))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    wrong = tmp_path / "config.json"
    wrong.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    proc = run("estimate", str(wrong))
    assert proc.returncode == 2 and "model_type: 'bert' is not supported" in proc.stderr
    missing = run("estimate", "llama-3-8b", "--train", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_presets_lists_gpus_and_models() -> None:
    proc = run("presets", "--format", "json")
    assert proc.returncode == 0
    out = json.loads(proc.stdout)
    names = {g["name"] for g in out["gpus"]}
    assert {
        "A100-40GB",
        "A100-80GB",
        "H100-80GB",
        "H200-141GB",
        "GH200",
        "L40S",
        "RTX-3090",
        "RTX-4090",
    } <= names
    assert all(g["source"] for g in out["gpus"])
    models = {m["name"]: m["params_total"] for m in out["models"]}
    assert models["llama-3-8b"] == 8_030_261_248
    text = run("presets")
    assert text.returncode == 0 and "H200-141GB" in text.stdout


def test_the_text_says_what_it_assumed_and_reads_without_a_legend() -> None:
    """One line of assumptions (batch, layout with ZeRO, framework, recompute, precision,
    optimizer, offload); no 'stage 0' that reads like a ZeRO stage; no 'of —' for host RAM
    nobody gave; the ranks a node's host RAM holds named when the layout has several."""
    proc = run_wide(
        "estimate", "llama-3-8b", "--set", "parallel.dp=8", "--set", "parallel.zero_stage=1"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (assumed,) = [line for line in lines if line.startswith("assumed: ")]
    for part in (
        "micro-batch 1 x 4,096 tokens",
        "grad accumulation 1",
        "DP 8 (ZeRO 1), TP 1, PP 1",
        "framework none",
        "recompute none",
        "precision params bf16",
        "adamw (fused)",
        "offload none",
    ):
        assert part in assumed, (part, assumed)
    assert not any("stage 0" in line for line in lines), proc.stdout
    verdict = next(line for line in lines if line.startswith("GPU peak"))
    assert "of —" not in verdict and "(no host memory given: not checked)" in verdict
    assert "--gpus-per-node counts the ranks" in verdict
    piped = run_wide("estimate", "llama-3-8b", "--set", "parallel.pp=2")
    assert "pipeline stage 1 (the heaviest)" in piped.stdout, piped.stdout
    v = run_wide(
        "estimate",
        "llama-3-8b",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.pp_schedule=DualPipeV",
        "--set",
        "grad_accum_steps=4",
    )
    assert v.returncode == 0, v.stderr
    (assumed_v,) = [line for line in v.stdout.splitlines() if line.startswith("assumed: ")]
    assert (
        "PP 2 x 2 virtual (DualPipeV, in a V: the first stage holds the embedding and the head)"
        in (assumed_v)
    )
    assert "pipeline stage 0 (the heaviest)" in v.stdout, v.stdout
