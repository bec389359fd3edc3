"""Published GPU runs (``calibration/data/published-memory.json``): every run is a fact with a
source, mapped to a spec the estimate prices, and the estimate's standing on them is held so
that no change can quietly make it worse.

The bounds below are where the estimate stands today, per stack and over all runs; the
targets (95 % of verdicts right, median |error| 5 %, nothing under by more than 10 %) are
higher, and each term that closes the gap tightens them here. A change that moves an estimate
the wrong way fails this file, naming the runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from headroom import planner
from headroom.calibration import published
from headroom.planner.estimator import stage_peaks

RUNS = published.runs()
STACKS = {"torchtitan", "torchtune", "megatron", "megatron-deepspeed", "deepspeed", "fsdp1", "ddp"}
COMMIT = re.compile(r"[0-9a-f]{40}")


@pytest.fixture(scope="module")
def replays() -> list[published.Replay]:
    return published.replay_all()


def test_every_run_is_a_fact_with_a_source() -> None:
    """19 runs to start from and at least 25 more; each with its URL, commit (where the source
    is a repository file), the quote, the configuration, which figure and the outcome."""
    assert len(RUNS) >= 44
    assert len({r["id"] for r in RUNS}) == len(RUNS)
    for run in RUNS:
        source = run["source"]
        assert source["url"].startswith("https://"), run["id"]
        assert source["quote"].strip(), run["id"]
        if "/blob/" in source["url"]:
            assert source["commit"] and COMMIT.fullmatch(source["commit"]), run["id"]
            assert source["commit"] in source["url"], run["id"]
        assert run["stack"] in STACKS, run["id"]
        assert run["figure"] in published.FIGURES, run["id"]
        assert run["outcome"] in ("fit", "oom"), run["id"]
        assert run["confidence"] in ("high", "medium", "low"), run["id"]
        assert run["configuration"] and run["mapping"].strip(), run["id"]
        if run["figure"] in ("oom", "none"):
            assert run["measured_gib"] is None, run["id"]
            assert (run["figure"] == "oom") == (run["outcome"] == "oom"), run["id"]
        else:
            assert run["measured_gib"] > 0 and run["outcome"] == "fit", run["id"]
    excluded = published.load()["excluded"]
    assert all(e["why"].strip() and e["source_url"].startswith("https://") for e in excluded)


def test_both_outcomes_and_every_figure_are_there() -> None:
    figures = {r["figure"] for r in RUNS}
    assert {"max_allocated", "max_reserved", "peak_active", "nvidia_smi_total", "oom"} <= figures
    ooms = [r for r in RUNS if r["outcome"] == "oom"]
    assert len(ooms) >= 8
    assert {r["stack"] for r in ooms} >= {"torchtitan", "deepspeed", "fsdp1", "ddp"}


def test_the_split_was_fixed_by_a_rule_before_fitting() -> None:
    """Within each stack, runs sorted by id alternate fit, held_out, fit, ...: a rule that no
    estimate can have chosen."""
    by_stack: dict[str, list[dict[str, object]]] = defaultdict(list)
    for run in RUNS:
        by_stack[run["stack"]].append(run)
    for runs in by_stack.values():
        ordered = sorted(runs, key=lambda r: str(r["id"]))
        assert [r["split"] for r in ordered] == [
            "fit" if i % 2 == 0 else "held_out" for i in range(len(ordered))
        ]


def test_every_spec_is_one_the_estimate_prices(replays: list[published.Replay]) -> None:
    assert [r.id for r in replays if r.refused] == []


def test_like_is_compared_with_like() -> None:
    """Allocated and active peaks leave out the context and the allocator's slack, a reserved
    peak the context, an nvidia-smi total nothing."""
    budget = planner.estimate(
        planner.load_model("llama-3-8b"), planner.TrainSpec(), planner.gpu("H100-80GB")
    )
    buckets, peak = budget.gpu.buckets, budget.gpu_peak_bytes
    context, slack = buckets["cuda_context"], buckets["allocator_overhead"]
    assert context > 0 and slack > 0
    assert published.comparable_bytes(budget, "max_allocated") == peak - context - slack
    assert published.comparable_bytes(budget, "peak_active") == peak - context - slack
    assert published.comparable_bytes(budget, "max_reserved") == peak - context
    assert published.comparable_bytes(budget, "nvidia_smi_total") == peak
    assert published.comparable_bytes(budget, "oom") is None


def test_a_figure_one_rank_logged_is_compared_with_that_ranks_stage() -> None:
    """Megatron-LM writes its memory statistics from the last rank only (the TensorBoard
    writer of ``global_vars.py``), which under pipeline parallelism is the last stage: every
    such run with pp > 1 names it, and is compared with the last stage's estimate, not the
    heaviest stage's. The heaviest of the stages is the estimate's own peak."""
    staged = 0
    for run in RUNS:
        pp = run["spec"]["train"].get("parallel", {}).get("pp", 1) or 1
        rank = run["rank"] or ""
        if pp > 1 and rank.startswith(("last rank", "world_size-1")):
            assert run.get("measured_stage") == "last", run["id"]
        elif pp > 1 and rank.startswith("rank 0"):
            assert run.get("measured_stage") == "first", run["id"]
        else:
            assert "measured_stage" not in run, run["id"]
        if "measured_stage" not in run:
            continue
        staged += 1
        model, train, hardware = published.spec_of(run)
        budget = planner.estimate(model, train, hardware)
        peaks = stage_peaks(model, train, hardware)
        assert [p.stage for p in peaks] == [0, pp - 1], run["id"]
        heaviest = max(peaks, key=lambda p: p.peak_bytes)
        assert heaviest.peak_bytes == budget.gpu_peak_bytes, run["id"]
        assert heaviest.phase == budget.peak_phase, run["id"]
        chosen = peaks[0] if run["measured_stage"] == "first" else peaks[-1]
        replayed = published.replay(run)
        assert replayed.measured_stage == run["measured_stage"]
        assert replayed.predicted_gib is not None
        assert replayed.predicted_gib * published.GIB == published.stage_bytes(
            chosen, run["figure"]
        )
    assert staged == 14
    # the tiny GPT on four stages logs its last stage, one micro-batch in flight: 2.45 GiB
    # where the first stage, with four, holds 3.38
    tiny = next(r for r in RUNS if r["id"] == "mlm_gpt_tiny_pp4_local_impl_h100")
    peaks = stage_peaks(*published.spec_of(tiny))
    assert peaks[0].allocated_bytes > 1.3 * peaks[-1].allocated_bytes


def test_a_stages_figures_are_allocated_reserved_and_the_whole_gpu() -> None:
    """A stage's reserved figure adds the allocator's overhead to its allocated bytes, its
    whole-GPU figure the CUDA context too, as the estimate's buckets do."""
    model = planner.load_model("llama-3-8b")
    train = planner.TrainSpec.model_validate(
        {"parallel": {"pp": 4}, "grad_accum_steps": 8, "micro_batch_size": 1}
    )
    hardware = planner.gpu("H100-80GB")
    budget = planner.estimate(model, train, hardware)
    first, last = stage_peaks(model, train, hardware)
    buckets = budget.gpu.buckets
    assert budget.stage == 0 and first.peak_bytes == budget.gpu_peak_bytes
    assert first.reserved_bytes - first.allocated_bytes == buckets["allocator_overhead"]
    assert first.peak_bytes - first.reserved_bytes == buckets["cuda_context"]
    assert last.stage == 3 and last.peak_bytes - last.reserved_bytes == buckets["cuda_context"]
    assert 0 < last.reserved_bytes - last.allocated_bytes < buckets["allocator_overhead"] * 2


#: where the estimate stands, per stack: (runs, at least right, at most median |error| %,
#: worst under-prediction at least, %); no stack may have a false fit
STANDING = {
    "all": (70, 70, 6.1, -25.6),
    # torchtitan's compiled loss as loss.compiled (B200 +31.0 -> +7.3 %, MI300X +12.9 ->
    # -7.5 %, the Trainy H200 rows +50 -> +15 %): 12.7 -> 7.4 %
    "torchtitan": (24, 24, 7.5, -25.7),
    # the worst under-prediction is the fp8 run (fp8 weights and their transposes); the run with
    # --cross-entropy-loss-fusion, once the worst (-27.1 %), is -4.9 % as loss.impl fused;
    # compared on the stage that logged the figure (the last), the pipelined runs 4.7 -> 4.0 %
    "megatron": (26, 26, 4.1, -20.5),
    "deepspeed": (10, 10, 9.0, -12.1),
    # CEWithChunkedOutputLoss as loss.impl chunked: 25.3 -> 20.2 %; optimizer_in_bwd as
    # optimizer_in_backward (its row +29.5 -> +11.7 %): 20.2 -> 14.4 %; the chunked loss
    # compiled (loss.compiled, compile: true) moves four rows by 2 bytes a logit: the
    # optimizer-in-backward row +11.7 -> +0.0 %, 8-bit AdamW +12.6 -> -2.7 %; torchtune's
    # own decoder code as the torchtune profile and its compiled layers as compile (the compile
    # row +14.4 -> -2.6 %, chunked CE +17.0 -> -3.1 %, the packed row -2.8 -> +3.9 %): 14.4 ->
    # 3.1 %
    "torchtune": (7, 7, 3.2, -3.2),
    "megatron-deepspeed": (1, 1, 20.6, -0.0),
}


def test_every_run_names_the_loss_it_ran() -> None:
    """A run with Megatron's --cross-entropy-loss-fusion prices loss.impl fused, a run with
    torchtune's CEWithChunkedOutputLoss loss.impl chunked with its 8 chunks, a torchtitan run
    whose commit compiles the loss with training.compile loss.compiled (torchtune's chunked
    loss with compile: true too); no run lists
    any of them as not modelled any more."""
    named = 0
    for run in RUNS:
        settings = run["configuration"].get("settings") or {}
        loss = run["spec"]["train"].get("loss", {"impl": "standard"})
        fusion = True in (
            settings.get("--cross-entropy-loss-fusion"),
            settings.get("cross_entropy_loss_fusion"),
        )
        chunked = str(settings.get("loss", "")).startswith(
            ("CEWithChunkedOutputLoss", "torchtune CEWithChunkedOutputLoss")
        )
        compiled = str(settings.get("loss", "")).startswith("cross_entropy_loss compiled")
        if fusion:
            assert loss == {"impl": "fused"}, run["id"]
        elif compiled:
            assert loss == {"impl": "standard", "compiled": True}, run["id"]
            assert run["stack"] == "torchtitan" and settings["compile"] is True, run["id"]
        elif chunked:
            # torchtune's compile_loss compiles the chunked loss's compute_cross_entropy
            want = {"impl": "chunked", "chunks": 8}
            if settings.get("compile") is True:
                want["compiled"] = True
            assert loss == want, run["id"]
        else:
            assert loss["impl"] == "standard" and not loss.get("compiled"), run["id"]
        named += bool(fusion or chunked or compiled)
        for item in run.get("not_modelled", []):
            assert "cross-entropy" not in item and "CEWithChunkedOutputLoss" not in item, run["id"]
    assert named == 17


def test_a_compiled_run_prices_its_compiled_layers_or_says_it_cannot() -> None:
    """A run whose source compiles its model: torchtune's runs (their own model code, the
    torchtune profile, whose compiled layer is traced) say compile true; the others, whose
    profiles have no compiled layer traced, list torch.compile as not modelled."""
    compiled = [
        r for r in RUNS if (r["configuration"].get("settings") or {}).get("compile") is True
    ]
    assert len(compiled) == 22
    for run in compiled:
        train = run["spec"]["train"]
        if run["stack"] == "torchtune":
            assert train["activation_profile"] == "torchtune" and train["compile"] is True
            assert not any("compile" in item for item in run["not_modelled"]), run["id"]
        else:
            assert "compile" not in train, run["id"]
            assert any("torch.compile" in item for item in run["not_modelled"]), run["id"]
    for run in RUNS:
        if run["stack"] == "torchtune":
            assert run["spec"]["train"]["activation_profile"] == "torchtune", run["id"]
        if run not in compiled:
            assert "compile" not in run["spec"]["train"], run["id"]


def test_a_run_that_steps_in_its_backward_says_so() -> None:
    """torchtune's optimizer_in_bwd is optimizer_in_backward in the spec, and no longer listed
    as not modelled."""
    stepped = [
        r
        for r in RUNS
        if (r["configuration"].get("settings") or {}).get("optimizer_in_bwd") is True
    ]
    assert len(stepped) == 2
    for run in stepped:
        assert run["spec"]["train"]["optimizer_in_backward"] is True, run["id"]
        assert not any("optimizer_in_bwd" in item for item in run["not_modelled"]), run["id"]
    others = [r for r in RUNS if r not in stepped]
    assert not any(r["spec"]["train"].get("optimizer_in_backward") for r in others)


def test_no_false_fit_and_no_stack_gets_worse(replays: list[published.Replay]) -> None:
    assert [r.id for r in replays if r.false_fit] == []
    summaries = {s.group: s for s in published.summaries(replays)}
    for group, (runs, right, median, under) in STANDING.items():
        s = summaries[group]
        wrong = [r.id for r in replays if not r.right and group in ("all", r.stack)]
        assert s.runs == runs, group
        assert s.right >= right, (group, wrong)
        assert s.median_abs_error_pct is not None and s.median_abs_error_pct <= median, group
        assert s.worst_under_pct is None or s.worst_under_pct >= under, group


def test_the_table_prints_every_run_and_a_summary_per_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "headroom.calibration.published"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for run in RUNS:
        assert run["id"] in done.stdout
    for stack in {r["stack"] for r in RUNS}:
        assert re.search(rf"^{re.escape(stack)}\s+\d+\s+\d+", done.stdout, re.M), stack
    as_json = subprocess.run(
        [sys.executable, "-m", "headroom.calibration.published", "--json", "--stack", "deepspeed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(as_json.stdout)
    assert {r["stack"] for r in out["runs"]} == {"deepspeed"}
    assert out["summaries"][-1]["group"] == "all"
    wrong = subprocess.run(
        [sys.executable, "-m", "headroom.calibration.published", "--stack", "jax"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2 and "no run matches --stack jax" in wrong.stderr


def test_the_runs_support_a_default_margin_of_six_percent() -> None:
    """The largest whole-percent margin at which the fitted split keeps every verdict it has at
    0 %: 6 %; at it the held-out split keeps every verdict too and has no false fit; at 7 %
    the fitted split turns a run that fit into an OOM."""
    sweep = published.margin_sweep(range(9))
    assert published.default_margin_pct(sweep) == 6
    # and it is the estimate's default: every verdict above is made with it
    assert round(planner.DEFAULT_MARGIN_FRACTION * 100) == 6
    assert planner.default_coefficients("textbook").margin_fraction == 0.06
    at = {(m.margin_pct, m.split): m for m in sweep}
    assert at[6, "held_out"].right == at[0, "held_out"].right
    assert at[6, "held_out"].false_fits == at[6, "fit"].false_fits == 0
    assert at[7, "fit"].false_ooms > at[0, "fit"].false_ooms
    # a made-up sweep: the margin stops at the first one that loses a fitted verdict
    made = [
        published.MarginRow(m, "fit", right, 0, 10 - right)
        for m, right in [(0, 10), (1, 10), (2, 9), (3, 10)]
    ]
    assert published.default_margin_pct(made) == 1
