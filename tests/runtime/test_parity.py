"""CPU parity in fp32: every placement trains exactly like plain PyTorch AdamW.

Tiny dense, MoE and MLA models (tied embeddings, GQA or DeepSeek's multi-head latent attention, a
shared expert, a dense first layer, fp32 routing weights), five
steps, EMA on: losses, final fp32 master weights and the EMA agree with the reference within
1e-5 relative, for optimizer offload (f = 0, 0.5, 1) and streaming (checkpoint every 1, 2 and
all layers; 2 and 3 device buffers; gradient accumulation 1 and 3), with clipping and, for
streaming, without (where each unit is updated as its last gradient lands).
"""

from __future__ import annotations

import threading
from functools import cache

import pytest
import torch

from headroom import planner
from headroom.runtime import trainer as trainer_module
from headroom.runtime.streams import DelayedBackend
from headroom.runtime.trainer import Result, RunConfig, Unit, train_model

STEPS = 5
BASE = {"micro_batch_size": 2, "seq_len": 16, "ema": "host"}
TOL = 1e-5


@cache
def reference(model: str, grad_accum: int, max_grad_norm: float | None = 1.0) -> Result:
    spec = planner.load_model(model)
    train = planner.TrainSpec(**BASE, grad_accum_steps=grad_accum, max_grad_norm=max_grad_norm)
    return train_model(spec, train, RunConfig(steps=STEPS, reference=True))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def assert_parity(result: Result, ref: Result) -> None:
    assert len(result.losses) == len(ref.losses) == STEPS
    for got, want in zip(result.losses, ref.losses, strict=True):
        assert got == pytest.approx(want, rel=TOL)
    assert result.state.keys() == ref.state.keys()
    for name, want in ref.state.items():
        assert _relative(result.state[name], want) <= TOL, name
    assert result.ema is not None and ref.ema is not None
    for name, want in ref.ema.items():
        assert _relative(result.ema[name], want) <= TOL, name
    # the run really trained: the loss moved and the weights left their initialisation
    assert ref.losses[-1] != ref.losses[0]


CASES = [
    ({"mode": "optimizer", "fraction": 0.0}, 1),
    ({"mode": "optimizer", "fraction": 0.5}, 1),
    ({"mode": "optimizer", "fraction": 1.0}, 1),
    ({"mode": "optimizer", "fraction": 0.5}, 3),
    ({"mode": "streaming", "checkpoint_every": 1, "num_buffers": 2}, 1),
    ({"mode": "streaming", "checkpoint_every": 2, "num_buffers": 3}, 1),
    ({"mode": "streaming", "checkpoint_every": 4, "num_buffers": 2}, 1),  # all layers
    ({"mode": "streaming", "checkpoint_every": 1, "num_buffers": 3}, 3),
    ({"mode": "streaming", "checkpoint_every": 2, "num_buffers": 2}, 3),
]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe", "tiny-mla"])
@pytest.mark.parametrize(("offload", "grad_accum"), CASES)
def test_placement_matches_reference(
    model: str, offload: dict[str, object], grad_accum: int
) -> None:
    spec = planner.load_model(model)
    train = planner.TrainSpec(**BASE, grad_accum_steps=grad_accum, offload=offload)
    result = train_model(spec, train, RunConfig(steps=STEPS))
    assert result.placement["mode"] == offload["mode"]
    assert_parity(result, reference(model, grad_accum))


def test_offload_split_is_the_planners() -> None:
    spec = planner.load_model("tiny-moe")
    train = planner.TrainSpec(**BASE, offload={"mode": "optimizer", "fraction": 0.5})
    result = train_model(spec, train, RunConfig(steps=1))
    from headroom.planner.stage import offloaded_numel, stage_params

    dense, expert = offloaded_numel(stage_params(spec, 1, 1, 1, 0), 1, 1, 0.5)
    assert result.placement["offloaded_params"] == dense + expert
    assert result.placement["total_params"] == planner.count_params(spec).total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_survives_late_and_reordered_copies(seed: int) -> None:
    """A backend that delays every copy until its event is waited on (and completes others in
    a random order) still trains exactly: every copy is waited on before its data is used, and
    no buffer is refilled while a consumer holds it."""
    spec = planner.load_model("tiny-moe")
    train = planner.TrainSpec(
        **BASE,
        grad_accum_steps=3,
        offload={"mode": "streaming", "checkpoint_every": 2, "num_buffers": 2},
    )
    backend = DelayedBackend(seed=seed)
    result = train_model(spec, train, RunConfig(steps=STEPS), backend=backend)
    assert_parity(result, reference("tiny-moe", 3))
    assert backend.copies > 0 and backend.waited > 0
    # every host->device copy that was used was waited on; none is left dangling
    assert backend.unwaited() <= train.offload.num_buffers
    assert result.placement["peak_buffers_in_use"] <= train.offload.num_buffers


def test_streaming_without_waits_is_caught() -> None:
    """The delayed backend is a real check: skipping the waits breaks parity."""
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(**BASE, offload={"mode": "streaming", "checkpoint_every": 1})

    class NoWait(DelayedBackend):
        def wait(self, event: object) -> None:  # type: ignore[override]
            return None

    result = train_model(spec, train, RunConfig(steps=2), backend=NoWait(seed=0, drift=0.0))
    ref = reference("tiny-dense", 1)
    # unwaited copies never land: the compute reads the pool's NaN fill, not the weights
    assert any(
        not abs(a - b) <= TOL * abs(b) for a, b in zip(result.losses, ref.losses[:2], strict=True)
    )


def test_streaming_streams_each_layer_twice_per_micro_batch_with_k1() -> None:
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(**BASE, offload={"mode": "streaming", "checkpoint_every": 1})
    result = train_model(spec, train, RunConfig(steps=1))
    layers = spec.num_layers
    # embedding + head + tied embedding for the head, then every layer forward and backward
    assert result.placement["host_to_device_loads"] <= 2 * layers + 3


def test_streaming_without_prefetch_trains_the_same() -> None:
    """The double-buffering ablation changes timing only, never the numbers."""
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(**BASE, offload={"mode": "streaming", "checkpoint_every": 2})
    result = train_model(spec, train, RunConfig(steps=STEPS, prefetch=False))
    assert_parity(result, reference("tiny-dense", 1))


def _qk_norm(name: str) -> planner.ModelSpec:
    return planner.load_model(name).model_copy(update={"qk_norm": True})


@pytest.mark.parametrize(
    "spec",
    [
        planner.load_model("tiny-dense"),
        planner.load_model("tiny-moe"),
        _qk_norm("tiny-dense"),
        _qk_norm("tiny-moe"),
        planner.load_model("tiny-moe").model_copy(
            update={"qkv_bias": True, "attention_out_bias": True, "mlp_bias": True}
        ),
        planner.load_model("tiny-mla"),
        planner.load_model("tiny-mla").model_copy(
            update={
                "mla": planner.load_model("tiny-mla").mla.model_copy(update={"q_lora_rank": None})
            }  # type: ignore[union-attr]
        ),
    ],
    ids=["dense", "moe", "dense-qk-norm", "moe-qk-norm", "llama-biases", "mla", "mla-no-q-lora"],
)
def test_parameters_are_the_planners_inventory(spec: planner.ModelSpec) -> None:
    """Names, sizes and order: what the offload split and the streaming units rely on."""
    from headroom.planner.params import units
    from headroom.runtime.model import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(spec)
    got = [(name, p.numel()) for name, p in model.named_parameters()]
    want = [(t.name, t.numel) for unit in units(spec) for t in unit.tensors]
    assert got == want


@pytest.mark.parametrize(
    "offload",
    [{"mode": "optimizer", "fraction": 0.5}, {"mode": "streaming", "checkpoint_every": 2}],
)
def test_query_key_norms_train_like_the_reference(offload: dict[str, object]) -> None:
    """Qwen3's per-head query/key norms: their weights learn, in every placement alike."""
    spec = _qk_norm("tiny-dense")
    ref = train_model(spec, planner.TrainSpec(**BASE), RunConfig(steps=STEPS, reference=True))
    result = train_model(spec, planner.TrainSpec(**BASE, offload=offload), RunConfig(steps=STEPS))
    assert_parity(result, ref)
    q_norm = ref.state["layers.0.self_attn.q_norm.weight"]
    assert not torch.equal(q_norm, torch.ones_like(q_norm))


UNCLIPPED = [
    ({"mode": "streaming", "checkpoint_every": 1, "num_buffers": 2}, 1, 0),
    ({"mode": "streaming", "checkpoint_every": 2, "num_buffers": 3}, 3, 1),
    ({"mode": "streaming", "checkpoint_every": 4, "num_buffers": 2}, 1, 2),  # all layers
]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe", "tiny-mla"])
@pytest.mark.parametrize(("offload", "grad_accum", "seed"), UNCLIPPED)
def test_unclipped_streaming_updates_as_gradients_land_and_matches_reference(
    model: str, offload: dict[str, object], grad_accum: int, seed: int
) -> None:
    """Without clipping, each unit's CPU AdamW starts as its last gradient of the step lands,
    while the backward goes on; under late and reordered copies it still trains exactly."""
    spec = planner.load_model(model)
    train = planner.TrainSpec(
        **BASE, grad_accum_steps=grad_accum, offload=offload, max_grad_norm=None
    )
    backend = DelayedBackend(seed=seed)
    result = train_model(spec, train, RunConfig(steps=STEPS), backend=backend)
    assert result.placement["cpu_update"] == "as_gradients_land"
    assert_parity(result, reference(model, grad_accum, None))
    assert backend.unwaited() <= train.offload.num_buffers


def test_the_clipped_cases_really_clip() -> None:
    """Clipping is active in these runs (the reference's gradient norm exceeds 1): the clipped
    and unclipped references part, so the parity cases above check both schedules."""
    clipped, unclipped = reference("tiny-dense", 1), reference("tiny-dense", 1, None)
    assert clipped.losses[0] == unclipped.losses[0]
    assert any(_relative(clipped.state[n], unclipped.state[n]) > 1e-3 for n in clipped.state)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_unclipped_updates_overlap_the_backward(
    max_grad_norm: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order and the overlap, observed: without clipping the updates run in landing order
    (head, last layer … first, embedding) and the head's is done before the backward ends;
    with clipping they wait for the step's norm and run in the next forward's order."""
    spec = planner.load_model("tiny-dense")
    train = planner.TrainSpec(
        **BASE,
        offload={"mode": "streaming", "checkpoint_every": 1},
        max_grad_norm=max_grad_norm,
    )
    order: list[tuple[int, str]] = []
    head_done = {step: threading.Event() for step in range(1, 3)}
    update = trainer_module._update_unit

    def recorded(o: object, step: int, u: Unit, coef: float) -> None:
        update(o, step, u, coef)  # type: ignore[arg-type]
        order.append((step, u.name))
        if u.name == "head":
            head_done[step].set()

    ended_after_head: dict[int, bool] = {}

    def hook(phase: str, step: int) -> None:
        if phase == "backward":
            # without clipping the head's update runs during the backward (a hang here fails
            # after 30 s); with clipping it cannot have started
            wait = 30.0 if max_grad_norm is None else 0.5
            ended_after_head[step] = head_done[step].wait(timeout=wait)

    monkeypatch.setattr(trainer_module, "_update_unit", recorded)
    train_model(spec, train, RunConfig(steps=2), on_phase=hook)
    layers = [f"layers.{i}" for i in range(spec.num_layers)]
    forward = ["embed_tokens", *layers, "head"]
    landing = ["head", *reversed(layers), "embed_tokens"]
    expected = landing if max_grad_norm is None else forward
    assert order == [(step, name) for step in (1, 2) for name in expected]
    assert ended_after_head == dict.fromkeys((1, 2), max_grad_norm is None)
