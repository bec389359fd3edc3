"""Data-parallel parity on CPU (gloo, fp32): ``headroom train`` under ``torchrun`` at 2 and 4
ranks trains exactly what one process trains on the same global batch.

Each case launches real processes (``python -m torch.distributed.run --standalone``), rank r
training on its ``micro_batch_size`` rows of each micro-batch, with gradient accumulation (2),
clipping or not, and a host EMA; rank 0 saves the final fp32 master weights and EMA
(``--save-weights``). One process trains ``micro_batch_size x dp`` sequences per micro-batch
with the same seed. Losses and the EMA agree within 1e-5 relative (the largest difference over
a tensor's elements, relative to its largest element); so do the final weights, tensor by
tensor, in norm.

The weights' element-wise difference is bounded by 1e-4 at 2 ranks and 2e-4 at 4 instead, and no
closer: a gradient element that is zero up to rounding (a few 1e-10 against 1e-3 elsewhere)
takes AdamW's first step as ``lr * g / (|g| + eps)``, so any change of summation order (two
half-batches summed, then averaged, against one batch) moves it by up to ``lr`` x a few percent
(6.35e-5 relative at the worst element of tiny-dense at 2 ranks; at 4 ranks, four partial sums,
up to 1.12e-4 on this project's CI host). So each run is also held, element by element, within
1e-5 of one process that sums in the ranks' order (``split_single``: each rank's rows through
their own backward, the ranks' gradients averaged, then the same AdamW).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import processes
import pytest
import torch

from headroom import planner
from headroom.runtime.adam import torch_adamw
from headroom.runtime.model import build_model, loss_fn, synthetic_batch
from headroom.runtime.streams import ALIGN
from headroom.runtime.trainer import Result, RunConfig, recompute_every, train_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
MICRO = 1  # sequences per rank and micro-batch
SETTINGS = {"seq_len": 16, "grad_accum_steps": 2, "ema": "host"}
TOL = 1e-5
#: the weights' largest element-wise difference by ranks (see the module's docstring): the more
#: partial sums, the further a near-zero gradient element's AdamW step moves
ELEMENT_TOL = {2: 1e-4, 4: 2e-4}


def _sets(train: dict[str, object]) -> list[str]:
    out = []
    for key, value in train.items():
        if isinstance(value, dict):
            out += [f"{key}.{k}={'null' if v is None else v}" for k, v in value.items()]
        else:
            out.append(f"{key}={'null' if value is None else value}")
    return [arg for s in out for arg in ("--set", s)]


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(
    ranks: int, train: dict[str, object], tmp: Path, steps: int = STEPS
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    report, weights = tmp / "report.json", tmp / "weights.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(ranks), "-m", "headroom", "train", "tiny-dense",
        "--steps", str(steps), "--dtype", "float32", *_sets(train),
        "--report", str(report), "--save-weights", str(weights),
    ]  # fmt: skip
    # bound: past the timeout torchrun and its ranks (in sessions of their own) are all killed
    proc = processes.run(cmd, timeout=120, env=_env(), cwd=ROOT)
    return proc, report, weights


@cache
def single(offload: tuple[tuple[str, object], ...], clip: float | None, batch: int) -> Result:
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(
        **SETTINGS, micro_batch_size=batch, max_grad_norm=clip, offload=dict(offload)
    )
    return train_model(spec, train, RunConfig(steps=STEPS))


@cache
def split_single(ranks: int, clip: float | None) -> dict[str, torch.Tensor]:
    """One process summing the ranks' gradients as the ranks do: each rank's rows of every
    micro-batch through their own backward, the ranks' gradients averaged, then the same
    clipping and torch AdamW (the arithmetic the ranks share, in their summation order)."""
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(**SETTINGS, micro_batch_size=MICRO * ranks, max_grad_norm=clip)
    o = RunConfig().optim
    model = build_model(spec, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    params = list(model.parameters())
    optimizer = torch_adamw(
        params, train.optimizer_impl, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
        weight_decay=o.weight_decay,
    )  # fmt: skip
    for step in range(1, STEPS + 1):
        total = [torch.zeros_like(p) for p in params]
        for r in range(ranks):
            model.zero_grad(set_to_none=True)
            rows = slice(r * MICRO, (r + 1) * MICRO)
            for micro in range(train.grad_accum_steps):
                ids, labels = synthetic_batch(
                    spec.vocab_size, MICRO * ranks, train.seq_len, step, micro, 0
                )
                loss = loss_fn(model(ids[rows], recompute_every(train)), labels[rows])
                (loss / train.grad_accum_steps).backward()
            for t, p in zip(total, params, strict=True):
                assert p.grad is not None
                t.add_(p.grad)
        for t, p in zip(total, params, strict=True):
            p.grad = t.div_(ranks)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _norm_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


CASES = [
    ({"mode": "none"}, 1.0, 2),
    ({"mode": "none"}, None, 4),
    ({"mode": "optimizer", "fraction": 0.5}, 1.0, 2),
    ({"mode": "optimizer", "fraction": 1.0}, None, 4),
    ({"mode": "streaming", "checkpoint_every": 2, "num_buffers": 2}, 1.0, 2),
    ({"mode": "streaming", "checkpoint_every": 1, "num_buffers": 3}, None, 4),
]


@pytest.mark.parametrize(("offload", "clip", "ranks"), CASES)
def test_dp_parity_with_one_process_on_the_global_batch(
    offload: dict[str, object], clip: float | None, ranks: int, tmp_path: Path
) -> None:
    train = {
        **SETTINGS,
        "micro_batch_size": MICRO,
        "max_grad_norm": clip,
        "parallel": {"dp": ranks},
        "offload": offload,
    }
    proc, report_path, weights_path = torchrun(ranks, train, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["placement"]["mode"] == offload["mode"]
    assert report["placement"]["data_parallel"] == ranks
    saved = torch.load(weights_path)
    ref = single(tuple(offload.items()), clip, MICRO * ranks)
    assert len(report["losses"]) == len(ref.losses) == STEPS
    for got, want in zip(report["losses"], ref.losses, strict=True):
        assert got == pytest.approx(want, rel=TOL)
    assert saved["state"].keys() == ref.state.keys()
    for name, want in ref.state.items():
        assert _norm_relative(saved["state"][name], want) <= TOL, name
        assert _relative(saved["state"][name], want) <= ELEMENT_TOL[ranks], name
    # element by element, the weights are those of one process summing in the ranks' order
    for name, want in split_single(ranks, clip).items():
        assert _relative(saved["state"][name], want) <= TOL, name
    assert ref.ema is not None and saved["ema"].keys() == ref.ema.keys()
    for name, want in ref.ema.items():
        assert _relative(saved["ema"][name], want) <= TOL, name
    # the run really trained
    assert ref.losses[-1] != ref.losses[0]
    assert any(not torch.equal(t, ref.ema[n]) for n, t in ref.state.items())


def test_dp_parity_refuses_a_world_other_than_parallel_dp(tmp_path: Path) -> None:
    """A rank of a 2-process torchrun world whose spec says ``parallel.dp`` 4 exits 2, naming
    it, before joining the world (so it needs no peers)."""
    train = {**SETTINGS, "micro_batch_size": MICRO, "parallel": {"dp": 4}}
    report = tmp_path / "report.json"
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    proc = processes.run(
        [sys.executable, "-m", "headroom", "train", "tiny-dense", "--steps", "1",
         *_sets(train), "--report", str(report)],
        timeout=60, env=_env() | torchrun_env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: parallel.dp:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_dp_parity_host_state_is_the_planners_node_budget(tmp_path: Path) -> None:
    """Streaming at dp = 2 on one node: what the two ranks pinned together is the planner's host
    budget for the layout (``ranks_sharing`` 2: per-rank buckets times the ranks), one copy of
    the master, moments and EMA, a working copy and an accumulator per rank, up to three
    differences, each bounded here: the trainer pads every carved field to ``ALIGN`` bytes and
    each unit's working copy and accumulator to ``dp`` equal pieces (the all-gather's output
    and the reduce-scatter's input), and the planner rounds
    each sharded bucket up to ``dp`` equal shares of the stage while the trainer splits each
    unit exactly."""
    ranks = 2
    fp32 = {"params": "fp32", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}
    offload = {"mode": "streaming", "checkpoint_every": 1}
    train = {
        **SETTINGS,
        "micro_batch_size": MICRO,
        "parallel": {"dp": ranks},
        "precision": fp32,
        "offload": offload,
    }
    proc, report_path, _ = torchrun(ranks, train, tmp_path, steps=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads(report_path.read_text())["placement"]
    per_rank = placement["host_state_bytes_per_rank"]
    assert len(per_rank) == ranks and per_rank[0] == placement["host_state_bytes"]
    assert placement["local_world_size"] == ranks  # one node: every rank shares its RAM
    spec = planner.load_model("tiny-dense")
    node = planner.gpu("H100-80GB").model_copy(update={"gpus_per_node": ranks})
    budget = planner.estimate(spec, planner.TrainSpec.model_validate(train), node)
    assert budget.host.ranks_sharing == ranks
    predicted = sum(budget.host.buckets.values())
    assert predicted == budget.host_peak_bytes
    measured = sum(per_rank)
    units = spec.num_layers + 2
    fields = 6  # working, master, two moments, accumulator, EMA
    padding = ranks * ((units * fields + 1) * ALIGN + units * 2 * (ranks - 1) * 4)
    rounding = ranks * 4 * (ranks - 1) * 4  # master, two moments, EMA: < dp elements each
    assert predicted - rounding <= measured <= predicted + padding, (predicted, measured)
    # one copy of the master, moments and EMA on the node: the ranks' pieces sum to the model
    sharded = sum(budget.host.buckets[b] for b in ("master_params", "optimizer_states", "ema"))
    assert abs(sharded - 4 * 4 * planner.count_params(spec).total) <= rounding


def test_dp_parity_optimizer_offload_host_state_is_the_planners_node_budget(
    tmp_path: Path,
) -> None:
    """Optimizer offload at dp = 2 on one node (no ZeRO stage): each rank pins its piece of the
    offloaded share's fp32 gradient, master and moments, and the two together are the
    planner's host budget for the node (one copy of the offloaded state), up to the trainer's
    padding of each tensor to equal pieces."""
    ranks = 2
    fp32 = {"params": "fp32", "grads": "fp32", "master": "fp32", "optimizer_states": "fp32"}
    train = {
        "seq_len": 16,
        "micro_batch_size": MICRO,
        "parallel": {"dp": ranks},
        "precision": fp32,
        "offload": {"mode": "optimizer", "fraction": 0.5},
    }
    proc, report_path, _ = torchrun(ranks, train, tmp_path, steps=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads(report_path.read_text())["placement"]
    measured = sum(placement["host_state_bytes_per_rank"])
    spec = planner.load_model("tiny-dense")
    node = planner.gpu("H100-80GB").model_copy(update={"gpus_per_node": ranks})
    budget = planner.estimate(spec, planner.TrainSpec.model_validate(train), node)
    assert budget.host.ranks_sharing == ranks
    padding = ranks * 4 * 4 * (ranks - 1) * (spec.num_layers + 2) * 8  # < dp elements a tensor
    assert (
        budget.host_peak_bytes <= measured + padding
        and measured <= budget.host_peak_bytes + padding
    )
    # one copy of the offloaded state on the node, not one per rank
    alone = planner.estimate(
        spec, planner.TrainSpec.model_validate({**train, "parallel": {"dp": 1}}), node
    )
    assert abs(budget.host_peak_bytes - alone.host_peak_bytes) <= padding
