"""``headroom plan`` through a real subprocess: the JSON contract, exit codes 0, 1 and 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from headroom_process import run_headroom, run_wide
from plan_bodies import worst_plan

from headroom import planner
from headroom.planner.cluster import cluster_preset

ARGS = ("--gpus", "16", "--gpus-per-node", "8", "--global-batch", "64", "--seq", "4096")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_headroom(*args, timeout=120)


def test_plan_prints_the_chosen_layout_as_json() -> None:
    proc = run("plan", "llama-3-70b", *ARGS, "--gpu", "H100-80GB", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("plan", "budget", "predicted_step_seconds", "candidates_considered"):
        assert out[key] is not None
    assert isinstance(out["runners_up"], list) and isinstance(out["rejected"], list)
    assert out["cluster"] == "DGX-H100" and out["gpus_per_node"] == 8
    plan = planner.TrainSpec.model_validate(out["plan"])
    assert plan.parallel.world_size <= 16 and plan.seq_len == 4096
    assert plan.micro_batch_size * plan.grad_accum_steps * plan.parallel.dp == 64
    budget = planner.estimate(planner.load_model("llama-3-70b"), plan, planner.gpu("H100-80GB"))
    # the node's host RAM is the cluster's (DGX H100: 2 TiB), the GPU the preset's
    assert out["budget"]["gpu"]["peak_bytes"] == budget.gpu_peak_bytes
    assert out["budget"]["host"]["capacity_bytes"] == cluster_preset("DGX-H100").host_memory_bytes


def test_plan_text_explains_the_step(tmp_path: Path) -> None:
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"precision": {"grads": "fp32"}, "framework": "megatron"}))
    proc = run(
        "plan", "llama-3-8b", *ARGS, "--cluster", "DGX-A100", "--train", str(train), "--explain"
    )
    assert proc.returncode == 0, proc.stderr
    assert "A100-80GB" in proc.stdout and "plan: tp" in proc.stdout
    for term in ("compute", "bubble", "tp_comm", "dp_comm", "step"):
        assert term in proc.stdout


def test_nothing_fitting_exits_1() -> None:
    proc = run(
        "plan",
        "llama-3.1-405b",
        "--gpus",
        "2",
        "--global-batch",
        "8",
        "--seq",
        "8192",
        "--format",
        "json",
    )
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] is False and out["plan"] is None
    assert out["rejected_by_reason"]["model_states"] > 0


def test_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({"name": "x", "gpu": "H100-80GB", "gpus_per_node": 8}))
    for args, field in [
        (("--cluster", "nope"), "cluster"),
        (("--cluster", str(bad)), "cluster.intra_node_bytes_per_s"),
        (("--gpu", "RTX-4090"), "cluster"),
        (("--set", "parallel.vpp=0"), "vpp"),
    ]:
        proc = run("plan", "llama-3-8b", *ARGS, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0] and "Traceback" not in proc.stderr
    proc = run("plan", "llama-3-8b", "--gpus", "0", "--global-batch", "8", "--seq", "8")
    assert proc.returncode == 2 and "--gpus" in proc.stderr


def test_a_search_over_its_budget_exits_2_naming_what_narrows_it(tmp_path: Path) -> None:
    """The report's body of highly divisible sizes (844,928 layouts: 87 s of CPU and 860 MiB)
    is refused before any layout is made."""
    model = tmp_path / "divisible.json"
    body = worst_plan()
    model.write_text(json.dumps(body["model"]))
    proc = run_headroom(
        "plan",
        str(model),
        *("--gpus", str(body["gpus"]), "--gpus-per-node", str(body["gpus_per_node"])),
        *("--global-batch", str(body["global_batch"]), "--seq", str(body["seq_len"])),
        timeout=60,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("error: gpus: planning at most 1024 GPUs would consider 720,396")
    assert "global_batch" in lines[0] and "100,000 layouts" in lines[0]


PLAN_70B = ("--gpus", "64", "--gpu", "H100-80GB", "--global-batch", "512", "--seq", "8192")


def _layout(c: dict[str, object]) -> tuple[object, ...]:
    p = c["parallel"]
    assert isinstance(p, dict)
    return tuple(p[k] for k in ("tp", "pp", "vpp", "cp", "ep", "dp", "zero_stage"))


def test_a_set_layout_key_is_a_constraint_the_plan_keeps() -> None:
    """``--set parallel.tp=8`` was ignored: the plan searched every TP and chose tp 1."""
    proc = run("plan", "llama-3-70b", *PLAN_70B, "--set", "parallel.tp=8", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["constraints"] == {"parallel.tp": 8}
    assert out["plan"]["parallel"]["tp"] == 8
    assert out["runners_up"] and {c["parallel"]["tp"] for c in out["runners_up"]} == {8}
    assert "with parallel.tp=8" in out["reason"]
    text = run("plan", "llama-3-70b", *PLAN_70B, "--set", "parallel.tp=8")
    assert text.returncode == 0 and "constraints: parallel.tp=8" in text.stdout


def test_a_constraint_no_layout_can_meet_exits_2_naming_its_key() -> None:
    for assignment, named in [
        ("parallel.tp=3", "train.parallel.tp: must divide num_heads (64)"),
        ("parallel.cp=3", "train.parallel.cp: load-balanced ring attention"),
    ]:
        proc = run("plan", "llama-3-70b", *PLAN_70B, "--set", assignment)
        assert proc.returncode == 2, (assignment, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "Traceback" not in proc.stderr


def test_a_framework_plans_its_own_zero_stages() -> None:
    """``--set framework=fsdp2`` (or deepspeed) exited 2 unless zero_stage was set by hand."""
    for framework, stages in (("fsdp2", [3]), ("deepspeed", [1, 2, 3])):
        proc = run(
            "plan", "llama-3-70b", *PLAN_70B, "--set", f"framework={framework}", "--format", "json"
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["zero_stages"] == stages and framework in out["zero_stages_reason"]
        assert out["plan"]["framework"] == framework
        assert out["plan"]["parallel"]["zero_stage"] in stages
    text = run("plan", "llama-3-70b", *PLAN_70B, "--set", "framework=fsdp2")
    assert text.returncode == 0, text.stderr
    assert "ZeRO stages searched: 3 (framework fsdp2" in " ".join(text.stdout.split())


def test_the_runners_up_are_distinct_layouts() -> None:
    """The issue's command: its ten runners-up were four layouts (offload fractions and
    micro-batches of the chosen one among them)."""
    proc = run("plan", "llama-3-70b", *PLAN_70B, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    layouts = [_layout(out["plan"]), *(_layout(c) for c in out["runners_up"])]
    assert len(out["runners_up"]) == 10 and len(set(layouts)) == len(layouts), layouts


def test_a_run_presets_layout_keys_are_its_constraints() -> None:
    proc = run(
        "plan",
        "llama-3-8b",
        *("--gpus", "64", "--global-batch", "128", "--seq", "8192"),
        *("--train", "torchtitan-llama3-8b", "--format", "json"),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # the keys its file names, not every key of its spec
    assert out["constraints"] == {
        "parallel.dp": 64,
        "parallel.zero_stage": 3,
        "micro_batch_size": 1,
        "recompute": "selective_op",
    }
    assert out["plan"]["framework"] == "fsdp2" and out["plan"]["grad_accum_steps"] == 2


def test_the_plan_text_explains_its_layout_keys() -> None:
    proc = run_wide(
        "plan", "llama-3-8b", "--gpus", "8", "--gpu", "H100-80GB", "--global-batch", "32",
        "--seq", "4096",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ppNxV: each rank holds V interleaved virtual stages" in proc.stdout
    assert "zeroS ZeRO stage S" in proc.stdout


def test_the_text_states_the_margin_and_band_and_flags_a_plan_near_capacity() -> None:
    """Llama 3 8B on two H100s at 16 x 8k: with --margin 0 --tie-band 0 the fastest layout
    peaks within 3 % of the GPU and is flagged; by default the margin and band are stated."""
    args = ("--gpus", "2", "--gpu", "H100-80GB", "--global-batch", "16", "--seq", "8192")
    tight = run_wide("plan", "llama-3-8b", *args, "--margin", "0", "--tie-band", "0")
    assert tight.returncode == 0, tight.stderr
    assert "margin 0 % of each peak; tie band 0 %" in tight.stdout
    assert "near capacity: the peak is within 3 % of the GPU's memory" in tight.stdout
    default = run_wide("plan", "llama-3-8b", *args)
    assert default.returncode == 0, default.stderr
    assert "margin 6 % of each peak (the default: the worst under-prediction" in default.stdout
    assert "tie band 2 %" in default.stdout and "near capacity" not in default.stdout
    bad = run("plan", "llama-3-8b", *args, "--tie-band", "80")
    assert bad.returncode == 2 and "--tie-band" in bad.stderr
