"""The trainer keeps the spec's state: 16-bit AdamW moments (computed in fp32, rounded once per
step), fp32 gradient accumulation beside 16-bit weights, the EMA where the spec puts it; and it
refuses, naming the field, what it does not keep."""

from __future__ import annotations

import math

import pytest
import torch
from headroom_process import run_headroom

from headroom import planner
from headroom.runtime.adam import AdamWConfig, adamw_step
from headroom.runtime.streams import ALIGN
from headroom.runtime.support import runtime_precision
from headroom.runtime.trainer import FoldGrads, RunConfig, train_model

CFG = AdamWConfig()


def _reference(p0: torch.Tensor, grads: list[torch.Tensor], states: torch.dtype) -> tuple:
    """AdamW in float64 whose moments are stored in ``states`` after every step."""
    p = p0.double().clone()
    m = torch.zeros_like(p0, dtype=states)
    v = torch.zeros_like(p0, dtype=states)
    for t, g in enumerate(grads, 1):
        g64 = g.double()
        p *= 1 - CFG.lr * CFG.weight_decay
        m64 = m.double() + (1 - CFG.beta1) * (g64 - m.double())
        v64 = CFG.beta2 * v.double() + (1 - CFG.beta2) * g64 * g64
        m, v = m64.to(states), v64.to(states)
        denom = v64.sqrt() / math.sqrt(1 - CFG.beta2**t) + CFG.eps
        p -= CFG.lr / (1 - CFG.beta1**t) * m64 / denom
    return p, m, v


@pytest.mark.parametrize("states", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_16bit_moments_are_rounded_once_per_step(
    states: torch.dtype, grad_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    n = 5000
    p0 = torch.randn(n)
    grads = [torch.randn(n).to(grad_dtype) for _ in range(6)]
    p, m, v = p0.clone(), torch.zeros(n, dtype=states), torch.zeros(n, dtype=states)
    for t, g in enumerate(grads, 1):
        adamw_step(CFG, t, p, g.clone(), m, v)
    want_p, want_m, want_v = _reference(p0, grads, states)
    # the stored moments are the roundings of the fp32 arithmetic's values: the float64
    # reference's own roundings, but where fp32 and float64 fall either side of a tie
    eps = torch.finfo(states).eps
    for got, want in ((m, want_m), (v, want_v)):
        differ = got != want
        assert differ.float().mean() < 0.01
        gap = (got.double() - want.double()).abs()[differ]
        assert bool((gap <= eps * want.double().abs()[differ]).all())  # one step apart at most
    assert float((p.double() - want_p).abs().max()) < 1e-5


def test_every_placement_keeps_bf16_moments_and_trains_alike() -> None:
    spec = planner.load_model("tiny-dense")
    results = {}
    for name, offload in [
        ("none", {"mode": "none"}),
        ("optimizer", {"mode": "optimizer", "fraction": 0.5}),
        ("streaming", {"mode": "streaming", "checkpoint_every": 2}),
    ]:
        train = planner.TrainSpec(
            micro_batch_size=2,
            seq_len=16,
            offload=offload,
            precision={"params": "fp32", "optimizer_states": "bf16"},
        )
        results[name] = train_model(spec, train, RunConfig(steps=4))
        assert results[name].placement["precision"]["optimizer_states"] == "bf16"
    base = results["none"]
    assert "reference" not in base.placement  # the trainer's AdamW, not torch's
    # the same gradients and the same update: resident and offloaded agree to the bit
    assert results["optimizer"].losses == base.losses
    for name, want in base.state.items():
        assert torch.equal(results["optimizer"].state[name], want), name
    # streaming's gradients differ in their last fp32 bits (the embedding's is an index_add),
    # and now and then a 16-bit moment rounds that to its other neighbour: one bf16 step of a
    # moment moves a weight by about lr x 2^-8
    stream = results["streaming"]
    for got, want in zip(stream.losses, base.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    for name, want in base.state.items():
        assert (stream.state[name] - want).abs().max() <= 4 * CFG.lr * 2**-8, name


def test_bf16_moments_halve_the_streaming_host_state() -> None:
    spec = planner.load_model("tiny-moe")
    n = planner.count_params(spec).total
    host = {}
    for states in ("fp32", "bf16"):
        train = planner.TrainSpec(
            micro_batch_size=1,
            seq_len=8,
            precision={"optimizer_states": states},
            offload={"mode": "streaming", "checkpoint_every": 1},
        )
        host[states] = train_model(spec, train, RunConfig(steps=1)).placement["host_state_bytes"]
    saved = host["fp32"] - host["bf16"]
    units = spec.num_layers + 2  # each unit's two moments are ALIGN-padded
    assert abs(saved - 4 * n) <= 2 * units * ALIGN, (saved, 4 * n)


def test_fp32_accumulation_sums_the_micro_batches_exactly() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    fold = FoldGrads(list(layer.named_parameters()))
    xs = [torch.randn(8, 64, dtype=torch.bfloat16) for _ in range(3)]
    want = torch.zeros(64 * 64)
    for x in xs:
        layer(x).square().sum().backward()
        assert layer.weight.grad is not None
        assert not layer.weight.grad.any()  # folded and zeroed, still allocated
        w = layer.weight.detach().clone().requires_grad_(True)
        x.requires_grad_(False)
        (x @ w.t()).square().sum().backward()
        assert w.grad is not None
        want += w.grad.reshape(-1).float()
    assert torch.equal(fold.acc["weight"], want)
    fold.remove()
    layer.weight.grad = None
    layer(xs[0]).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.any()  # hook gone


def test_fp32_gradients_train_in_bf16_and_say_so() -> None:
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(
        micro_batch_size=2, seq_len=16, grad_accum_steps=2, precision={"grads": "fp32"}
    )
    result = train_model(spec, train, RunConfig(steps=3, dtype=torch.bfloat16))
    assert result.placement["precision"] == {
        "params": "bf16",
        "grads": "fp32",
        "master": "fp32",
        "optimizer_states": "fp32",
    }
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]


def test_ema_on_the_device_matches_the_reference() -> None:
    spec = planner.load_model("tiny-moe")
    base = {"micro_batch_size": 2, "seq_len": 16, "ema": "gpu"}
    ref = train_model(spec, planner.TrainSpec(**base), RunConfig(steps=4, reference=True))
    train = planner.TrainSpec(**base, offload={"mode": "optimizer", "fraction": 0.5})
    result = train_model(spec, train, RunConfig(steps=4))
    assert result.ema is not None and ref.ema is not None
    for name, want in ref.ema.items():
        assert (result.ema[name] - want).abs().max() / want.abs().max() <= 1e-5, name


@pytest.mark.parametrize(
    ("precision", "offload", "message"),
    [
        ({"master": "bf16"}, "none", "allowed: fp32, none"),
        ({"master": "none"}, "streaming", "allowed with offloading: fp32"),
        ({"master": "none"}, "optimizer", "allowed with offloading: fp32"),
    ],
)
def test_what_the_trainer_does_not_keep_is_refused(
    precision: dict[str, str], offload: str, message: str
) -> None:
    train = planner.TrainSpec(precision=precision, offload={"mode": offload})
    with pytest.raises(planner.SpecError, match=message) as err:
        runtime_precision(train, "bf16")
    assert err.value.field == "precision.master"
    sets = [f"precision.{k}={v}" for k, v in precision.items()] + [f"offload.mode={offload}"]
    proc = run_headroom(
        "train",
        "tiny-dense",
        "--steps",
        "1",
        "--dtype",
        "bfloat16",
        *(a for kv in sets for a in ("--set", kv)),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "precision.master" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("fused", [True, False])
def test_fp32_adamw_is_torchs_to_the_bit(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """All-fp32 state runs ``torch.optim.AdamW(fused=True)``'s kernel chunk by chunk (or, where
    torch has none, the single-tensor path's ops): the chunks, the clipping scale folded into the
    gradient and the EMA and working copy written alongside change no bit of the update."""
    from headroom.runtime import adam

    monkeypatch.setattr(adam, "FUSED_ADAMW", fused)
    monkeypatch.setattr(adam, "CHUNK", 1000)  # several chunks and a ragged last one
    torch.manual_seed(0)
    n, scale = 4321, 0.37
    p0, grads = torch.randn(n), [torch.randn(n) for _ in range(4)]
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    ema, working = p0.clone(), torch.empty(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, 1):
        adamw_step(CFG, t, p, g.clone(), m, v, grad_scale=scale, ema=ema, working=working)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW(
        [ref], lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps,
        weight_decay=CFG.weight_decay, fused=fused, foreach=False if not fused else None,
    )  # fmt: skip
    ref_ema = p0.clone()
    for g in grads:
        ref.grad = g * scale
        opt.step()
        ref_ema.lerp_(ref.detach(), 1 - CFG.ema_decay)
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"])
    assert torch.equal(v, opt.state[ref]["exp_avg_sq"])
    assert torch.equal(ema, ref_ema)
    assert torch.equal(working, p.to(torch.bfloat16))
