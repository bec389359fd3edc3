"""``planner.price_spec``: a training spec's step exactly as given (``headroom estimate --step``,
``POST /estimate`` with ``step``), priced by the plan's step model: the same seconds the plan
gives that layout, whether it fits or not, and a layout its stack would not run refused
naming the key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from headroom_process import run_headroom

from headroom import planner
from headroom.planner.cluster import cluster_and_gpu, cluster_preset
from headroom.planner.constraints import PlanConstraints

SPEC = {
    "micro_batch_size": 1,
    "grad_accum_steps": 16,
    "seq_len": 8192,
    "recompute": "full",
    "framework": "megatron",
    "parallel": {"dp": 8, "tp": 8, "pp": 4, "zero_stage": 0, "sequence_parallel": True},
}
LLAMA70 = planner.load_model("llama-3-70b")


def _on_h100(train: dict[str, object]) -> planner.StepPrice:
    cluster, hw = cluster_and_gpu(None, planner.gpu("H100-80GB"), None)
    return planner.price_spec(LLAMA70, planner.TrainSpec.model_validate(train), cluster, hw)


def test_the_step_is_the_plans_for_that_layout() -> None:
    priced = _on_h100(SPEC)
    cluster, hw = cluster_and_gpu(None, planner.gpu("H100-80GB"), None)
    want = PlanConstraints(
        tp=8, pp=4, vpp=1, cp=1, ep=1, dp=8, zero_stage=0, sequence_parallel=True,
        micro_batch_size=1, grad_accum_steps=16, recompute="full", offload_mode="none",
        expandable_segments=False,
    )  # fmt: skip
    train = planner.TrainSpec.model_validate(SPEC)
    result = planner.plan(LLAMA70, train, cluster, hw, 256, 128, 8192, constraints=want)
    assert result.fits and result.predicted_step_seconds is not None
    assert priced.step_seconds == pytest.approx(result.predicted_step_seconds, rel=1e-12)
    assert [t.term for t in priced.terms] == [t.term for t in result.step]
    assert (priced.gpus, priced.global_batch, priced.cluster) == (256, 128, "DGX-H100")
    assert priced.tokens_per_second == pytest.approx(128 * 8192 / priced.step_seconds)
    # MFU: (6 x active parameters + 12 x layers x hidden x sequence) per token
    flops = 6 * planner.count_params(LLAMA70).per_token_active + 12 * 80 * 8192 * 8192
    assert priced.mfu == pytest.approx(flops * priced.tokens_per_second / (256 * 989e12))
    assert 0.1 < priced.mfu < 0.6


def test_a_spec_that_does_not_fit_is_priced_all_the_same() -> None:
    whole = {**SPEC, "parallel": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}}
    priced = _on_h100(whole)
    hw = planner.gpu("H100-80GB")
    assert not planner.estimate(LLAMA70, planner.TrainSpec.model_validate(whole), hw).fits
    assert priced.gpus == 1 and priced.step_seconds > _on_h100(SPEC).step_seconds
    # more GPUs of the same model: each term is its own, the bubble only where PP is
    bubble = {t.term: t.seconds for t in priced.terms}["bubble"]
    assert bubble == 0.0 < {t.term: t.seconds for t in _on_h100(SPEC).terms}["bubble"]


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"parallel": {"pp": 3}}, "train.parallel.pp", "pp must divide it"),  # 80 layers
        ({"parallel": {"tp": 16}}, "train.parallel.tp", "must divide num_kv_heads (8)"),
        ({"parallel": {"vpp": 3}}, "train.parallel.vpp", "pp x vpp equal chunks"),
        # Megatron-Core's interleaved schedule: micro-batches a multiple of pp
        ({"parallel": {"vpp": 2}, "grad_accum_steps": 6}, "grad_accum_steps", "pp (4) divides"),
    ],
)
def test_a_layout_its_stack_does_not_run_is_refused_naming_the_key(
    change: dict[str, object], field: str, words: str
) -> None:
    rest = {k: v for k, v in change.items() if k != "parallel"}
    parallel = {**SPEC["parallel"], **change.get("parallel", {})}  # type: ignore[dict-item]
    with pytest.raises(planner.SpecError) as info:
        _on_h100({**SPEC, **rest, "parallel": parallel})
    assert info.value.field == field and words in str(info.value)


def test_the_cli_and_the_api_price_the_same_step() -> None:
    sets = [
        "seq_len=8192", "grad_accum_steps=16", "recompute=full", "framework=megatron",
        "parallel.dp=8", "parallel.tp=8", "parallel.pp=4", "parallel.sequence_parallel=true",
    ]  # fmt: skip
    args = ["estimate", "llama-3-70b", "--gpu", "H100-80GB", "--step"]
    args += [a for s in sets for a in ("--set", s)]
    proc = run_headroom(*args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)["step"]
    expected = _on_h100(SPEC)
    assert cli["step_seconds"] == pytest.approx(expected.step_seconds, rel=1e-12)
    text = run_headroom(*args, env={**os.environ, "COLUMNS": "200"})
    assert text.returncode == 0, text.stderr
    assert "Step time, the spec as given" in text.stdout
    assert f"{expected.tokens_per_second:,.0f} tokens/s, MFU {100 * expected.mfu:.1f} %" in (
        text.stdout
    )
    # a cluster the CLI names: its links, its name
    on_b200 = run_headroom(*args, "--cluster", "DGX-B200", "--format", "json")
    assert on_b200.returncode == 0, on_b200.stderr
    assert json.loads(on_b200.stdout)["step"]["cluster"] == "DGX-B200"
    assert cluster_preset("DGX-B200").gpu == "B200"  # the links only: the GPU stays the H100


def test_the_api_answers_step_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from headroom.api.main import create_app

    monkeypatch.setenv("HEADROOM_DATABASE_URL", f"sqlite:///{tmp_path}/h.db")
    with TestClient(create_app()) as client:
        body = {"model": "llama-3-70b", "gpu": "H100-80GB", "train": SPEC}
        plain = client.post("/api/v1/estimate", json=body).json()
        assert plain.get("step") is None
        answer = client.post("/api/v1/estimate", json={**body, "step": True})
        assert answer.status_code == 200, answer.text
        step = answer.json()["step"]
        assert step["step_seconds"] == pytest.approx(_on_h100(SPEC).step_seconds, rel=1e-12)
        assert {t["term"] for t in step["terms"]} >= {"compute", "bubble", "tp_comm", "step"}
        bad = {**SPEC, "parallel": {**SPEC["parallel"], "pp": 3}}
        refused = client.post("/api/v1/estimate", json={**body, "train": bad, "step": True})
        assert refused.status_code == 422
        assert refused.headers["content-type"].startswith("application/problem+json")
