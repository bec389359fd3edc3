"""The step-time model against the Ultra-Scale Playbook's sweep of layouts on H100s
(``calibration/sweep.py``): the file is the figure's runs, verbatim; the H100's efficiency is
the fit the module gives; the errors and rank correlations docs/ESTIMATOR.md reports hold."""

from __future__ import annotations

import re

import pytest

from headroom import planner
from headroom.calibration import sweep as S
from headroom.calibration.throughput import published

GROUPS = S.groups()


def _group(model: str, gpus: int) -> S.Group:
    return next(g for g in GROUPS if (g.model, g.gpus) == (model, gpus))


def test_every_run_of_the_figure_is_in_the_file_and_parses_back_to_its_quote() -> None:
    runs = S.runs()
    # the blog: "over 4,100 distributed experiments"; the figure's crashed or OOM runs read nan
    assert len(runs) == 4104
    assert sum(r.tokens_per_s_per_gpu is not None for r in runs) == 1765
    for r in runs[:50]:
        assert S.parse(r.model, r.quote) == r
    # 26 quotes do not add up (GPUs or batch): never compared
    assert sum(not r.consistent for r in runs) == 26
    assert not any(S.priced(r) for r in runs if not r.consistent)
    with pytest.raises(ValueError, match="not a run of the sweep"):
        S.parse("1B", "Nodes: 1<br>MBS: 2")


def test_the_models_shapes_give_the_published_mfu() -> None:
    """The shapes are nanotron's benchmark script's, not printed beside the figure: each run's
    MFU x 989.5 TFLOP/s over its tokens/s is 6N + 12 L h s with N as Headroom counts it (runs
    without pipeline parallelism: with it, the figure counts the 1B's and 3B's tied embedding
    twice)."""
    checked = 0
    for run in S.runs():
        if run.tokens_per_s_per_gpu is None or run.pp != 1 or not run.consistent:
            continue
        shape = S.load()["models"][run.model]
        n = planner.count_params(planner.load_model(S.case(run)["model_spec"])).total
        flops = 6 * n + 12 * shape["layers"] * shape["hidden"] * S.load()["seq_len"]
        m = re.search(r"MFU:\s+(\S+)<br>", run.quote)
        assert m is not None
        implied = float(m.group(1)) / 100 * 989.5e12 / run.tokens_per_s_per_gpu
        assert implied == pytest.approx(flops, rel=4e-3), run.quote
        checked += 1
    assert checked > 450


def test_a_third_of_the_runs_is_held_out_by_the_file() -> None:
    priced = [r for r in S.runs() if S.priced(r)]
    held = [r for r in priced if r.held_out]
    assert len(held) >= len(priced) / 3
    assert {r.gpus for r in held} == set(S.load()["held_out"]["gpus"])


def test_the_h100s_efficiency_is_the_fit_of_its_fitting_runs() -> None:
    """torchtitan's 8-GPU run and the sweep's one-node runs (fit split), each source weighing
    the same: 0.465 (the A100s' 0.648 made every H100 run 20-30 % too fast)."""
    ids = [
        c["id"]
        for c in published()["cases"]
        if c["split"] == "fit" and c.get("cluster") == "DGX-H100" and not c.get("compile")
    ]
    runs = S.one_node_fit_runs()
    assert ids == ["torchtitan-h100-llama3-8b-fsdp8"] and len(runs) == 67
    assert all(not r.held_out and r.gpus == 8 for r in runs)
    fitted = S.fit_gpu_efficiency(ids, runs)
    assert fitted == pytest.approx(planner.gpu("H100-80GB").compute_efficiency, abs=5e-3)
    errors = S.source_errors(fitted, ids, runs)
    assert set(errors) == {"nanotron", "torchtitan"}
    assert all(abs(e) <= 0.02 for e in errors.values())


def test_one_and_two_node_groups_are_within_the_reported_error() -> None:
    """Median step-time error per group, reported in docs/ESTIMATOR.md: one node (fit) -2.6 ..
    +4.2 %, two nodes (held out) -1.3 ... +12.1 %."""
    for gpus in (8, 16):
        for model in ("1B", "3B", "8B"):
            g = _group(model, gpus)
            assert g.held_out == (gpus == 16)
            assert -0.05 <= g.median_error <= 0.13, g


def test_the_step_floors_are_measured_from_fit_runs_and_hold_on_the_held_out() -> None:
    """nanotron's floors come from measured times alone: 2.64 ms per layer-pass under TP on one
    node at micro-batch 1, and 4.17 + 1.11 x tp ms where the pipeline crosses nodes (8 nodes).
    The held-out runs (16, 32 and 128 GPUs), never looked at by the fit, give per-TP medians
    within 20 % of that line."""
    fl = S.fit_step_floors()
    assert 2.0e-3 <= fl["tp_host_layer_seconds"] <= 3.0e-3
    assert 3.0e-3 <= fl["pp_cross_node_layer_seconds"] <= 6.0e-3
    assert 0.8e-3 <= fl["pp_cross_node_layer_seconds_per_tp"] <= 1.5e-3
    for gpus in S.load()["held_out"]["gpus"]:
        for tp in S.FLOOR_FIT_TP:
            times = sorted(
                S.slot_layer_seconds(r)
                for r in S.runs()
                if S.priced(r) and r.gpus == gpus and r.pp > 1 and r.tp == tp
                if r.micro_batch <= 2
            )
            line = fl["pp_cross_node_layer_seconds"] + fl["pp_cross_node_layer_seconds_per_tp"] * tp
            assert times and abs(times[len(times) // 2] / line - 1) <= 0.20, (gpus, tp)


def test_the_floors_are_what_ranks_the_layouts() -> None:
    """With nanotron's floors, Spearman's rho is at least 0.8 in 16 of the 26 groups (3 without)
    and its mean rises from 0.60 to 0.76; the held-out groups' (which no floor was fitted to)
    range from 0.51-0.76 to 0.68-0.93. On one, two and eight nodes the 1B's and 3B's groups
    rank at 0.82 ... 0.92 and the model's first layout is the fastest measured (within 3 %)."""
    without = S.groups(floors=False)
    assert sum(g.spearman >= 0.8 for g in without) <= 3
    held = [g.spearman for g in GROUPS if g.held_out]
    assert len(held) == 10 and min(held) >= 0.65 and sorted(held)[5] >= 0.8
    assert sum(g.spearman >= 0.8 for g in GROUPS) >= 16
    mean = sum(g.spearman for g in GROUPS) / len(GROUPS)
    assert mean >= sum(g.spearman for g in without) / len(without) + 0.15
    for gpus in (8, 16, 64):
        for model in ("1B", "3B"):
            g = _group(model, gpus)
            assert g.spearman >= 0.8 and g.pick_ratio >= 0.97, g


def test_runs_near_capacity_ran_over_twice_as_long_as_priced() -> None:
    """Every run of at most eight nodes that reserved 70 GiB or more of the H100's 79.6 ran over
    twice as long as the model prices it (the allocator's retries are not priced); of the
    others, fewer than one in six. The 8B's one-node group, which the model ranked at 0.52
    (its first layout ran at 0.37 of the fastest, reserving 71.5 GiB), ranks at 0.94 without
    them, its first layout the fastest."""
    near, slow, others, others_slow = 0, 0, 0, 0
    for run in S.runs():
        if not S.priced(run) or run.gpus > 64:
            continue
        r = S.replay(run)
        over = r.published_seconds > 2 * r.predicted_seconds
        if S.near_capacity(run):
            near, slow = near + 1, slow + over
        else:
            others, others_slow = others + 1, others_slow + over
    assert near >= 15 and slow == near
    assert others_slow < others / 6
    g = _group("8B", 8)
    assert g.spearman < 0.6 and g.pick_ratio < 0.4
    clean = next(x for x in S.groups(without_near_capacity=True) if (x.model, x.gpus) == ("8B", 8))
    assert clean.spearman >= 0.9 and clean.pick_ratio == 1.0


def test_many_nodes_are_under_predicted_as_documented() -> None:
    """From 32 nodes up the sweep's steps are far slower than the model prices them (-24 % to
    -81 %, worse at 64 nodes): its cluster's network is not a DGX H100's, and its runs there
    repeat with differences of seconds. Reported, not fitted away: no coefficient of the model
    is fitted to these groups."""
    many = [g for g in GROUPS if g.gpus >= 256]
    assert len(many) == 9 and all(g.median_error < -0.2 for g in many)
    by_gpus = {gpus: max(g.median_error for g in many if g.gpus == gpus) for gpus in (256, 512)}
    assert by_gpus[512] < by_gpus[256]


def test_the_sweeps_memory_is_the_reported_one() -> None:
    """Reserved peaks (world rank 0's: the first stage's) against the first stage's estimate
    (docs/ESTIMATOR.md): data parallelism alone -0.8 % (median of 30); under TP -16 %, growing
    with the TP degree (TP 2 -6 %, TP 32 -34 %); under PP -25 % whatever the stages; both -34 %.
    Not fitted: the under-prediction is reported, and no coefficient moved for it."""
    rows = {m.kind: m for m in S.memory_rows()}
    assert [rows[k].runs for k in ("dp", "tp", "pp", "tp+pp")] == [30, 453, 159, 1110]
    assert abs(rows["dp"].median_error) <= 0.02
    assert -0.20 <= rows["tp"].median_error <= -0.12
    assert -0.30 <= rows["pp"].median_error <= -0.20
    assert -0.40 <= rows["tp+pp"].median_error <= -0.28
    by_tp: dict[int, list[float]] = {}
    for run in S.runs():
        if S.priced(run) and run.reserved_gib and run.pp == 1 and run.tp in (2, 32):
            by_tp.setdefault(run.tp, []).append(S.memory_error(run))
    tp2, tp32 = (sorted(by_tp[t])[len(by_tp[t]) // 2] for t in (2, 32))
    assert tp32 < tp2 - 0.2 < 0
