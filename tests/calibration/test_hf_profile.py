"""The ``hf`` profile: transformers models built from configs with random weights, traced on
the CPU under fake tensors, and the coefficients fitted to them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from headroom_process import run_headroom

from headroom import planner
from headroom.calibration import hf
from headroom.calibration.comparison import compare_trace
from headroom.calibration.design import deepseek_cut
from headroom.calibration.regression import FITTED, fit_coefficients, peak_errors
from headroom.calibration.shipped import shipped_entry
from headroom.calibration.trace_records import TraceRecord, TracesFile
from headroom.calibration.tracing import steady_forward_transient, trace

RECORDS = Path(__file__).resolve().parents[2] / "calibration" / "data" / "hf-traces.json"
PURE_BF16 = {"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"}
FAMILIES = {"llama", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3"}


@pytest.fixture(scope="module")
def records() -> list[TraceRecord]:
    return list(TracesFile.model_validate_json(RECORDS.read_text()).records)


def _family(record: TraceRecord) -> str:
    return str(hf.config_for(record.model)["model_type"])


@pytest.mark.parametrize(
    "name",
    [
        "llama-3-8b",
        "mistral-7b",
        "qwen2-7b",
        "mixtral-8x7b",
        "qwen1.5-moe-a2.7b",
        "qwen3-8b",
        "qwen3-30b-a3b",
    ],
)
def test_built_models_have_the_planners_parameter_count(name: str) -> None:
    spec = planner.load_model(name)
    with torch.device("meta"):
        net = hf.build(hf.config_for(spec))
    assert sum(p.numel() for p in net.parameters()) == planner.count_params(spec).total


def test_deepseek_v3_is_built_with_the_planners_tensors() -> None:
    """Its three dense layers and one MoE layer, without the MTP module transformers does not
    build. The aux-loss-free routing bias, which a rule updates, is a buffer there; the planner
    counts it with the parameters (its gradient and moments: 256 elements per MoE layer)."""
    spec = deepseek_cut()
    with torch.device("meta"):
        net = hf.build(hf.config_for(spec))
    biases = {k: b.numel() for k, b in net.named_buffers() if "e_score_correction_bias" in k}
    assert biases == {"model.layers.3.mlp.gate.e_score_correction_bias": 256}
    params = sum(p.numel() for p in net.parameters())
    assert params + 256 == planner.count_params(spec).total == 15_111_101_696
    # read back from the config it is built from: the same spec
    assert hf.spec_of(hf.config_for(spec)).model_dump(exclude={"name", "source"}) == (
        spec.model_dump(exclude={"name", "source"})
    )


def _sdpa_calls(impl: str, model: planner.ModelSpec, train: planner.TrainSpec) -> list[tuple]:
    """(mask, is_causal, grouped, value narrower than query) of every call transformers made to
    SDPA in a trace (the GPU kernel choice, ``gpu_attention_kernels``, left out)."""
    import contextlib

    import torch.nn.functional as F

    from headroom.calibration import tracing as trace_module

    calls: list[tuple] = []
    original = F.scaled_dot_product_attention
    kernels = trace_module.gpu_attention_kernels
    trace_module.gpu_attention_kernels = contextlib.nullcontext  # type: ignore[assignment]

    def spy(q: Any, k: Any, v: Any, attn_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        is_causal = kwargs.get("is_causal", args[1] if len(args) > 1 else False)
        calls.append(
            (attn_mask is not None, is_causal, k.shape[1] < q.shape[1], v.shape[-1] < q.shape[-1])
        )
        return original(q, k, v, attn_mask, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        trace(model, train, impl=impl, steps=1)
    finally:
        F.scaled_dot_product_attention = original
        trace_module.gpu_attention_kernels = kernels
    return calls


def test_traces_attend_as_a_real_run_does() -> None:
    """No padding, one sequence per row: transformers passes SDPA no mask, ``is_causal`` and
    grouped keys and values, as on real tensors (under fake tensors it would otherwise keep a
    causal mask and repeat the keys and values)."""
    train = planner.load_train({"precision": PURE_BF16, "seq_len": 64, "activation_profile": "hf"})
    gqa = planner.load_model("llama-3-8b").model_copy(
        update={"num_layers": 1, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 2}
    )
    assert _sdpa_calls("hf", gqa, train) == [(False, True, True, False)]
    mla = planner.load_model("deepseek-v3").model_copy(
        update={
            "num_layers": 1,
            "hidden_size": 256,
            "num_heads": 4,
            "num_kv_heads": 4,
            "num_mtp_layers": 0,
            "moe": None,
        }
    )
    assert _sdpa_calls("hf", mla, train) == [(False, True, False, True)]


def test_narrow_values_trace_the_gpus_memory_efficient_kernel() -> None:
    """Multi-head latent attention's values are narrower than its queries: a GPU runs the
    memory-efficient kernel (no score is kept), the CPU the math one (every score is). The
    trace keeps what the GPU does: its activations do not grow with the sequence squared."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from headroom.calibration.tracing import gpu_attention_kernels

    def saved_bytes(seq: int) -> int:
        sizes: list[int] = []
        with FakeTensorMode(), gpu_attention_kernels():
            q, k = (torch.empty(1, 4, seq, 96, requires_grad=True) for _ in range(2))
            v = torch.empty(1, 4, seq, 64, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t
            ):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sum(sizes)

    # q, k, v, the output and the log-sum-exp: linear in the sequence
    assert saved_bytes(2048) <= 2.05 * saved_bytes(1024)


def test_held_out_configs_of_each_family_are_predicted_within_five_percent(
    records: list[TraceRecord],
) -> None:
    fit = [r for r in records if not r.held_out]
    held_out = [r for r in records if r.held_out]
    # whole shapes are held out: none of their widths is in the fit
    fitted_shapes = {(r.model.hidden_size, r.model.vocab_size) for r in fit}
    assert all((r.model.hidden_size, r.model.vocab_size) not in fitted_shapes for r in held_out)
    assert {_family(r) for r in held_out} >= FAMILIES
    coeffs = fit_coefficients(fit, "hf")
    errors = peak_errors(held_out, coeffs)
    assert max(abs(e) for e in errors) <= 0.05, errors
    # the full-width published models (two-layer cuts) are among them
    names = {r.model.name for r in held_out}
    assert {
        "llama-3-8b",
        "mixtral-8x7b",
        "qwen1.5-moe-a2.7b",
        "qwen3-8b",
        "qwen3-30b-a3b",
        "deepseek-v3",
    } <= names
    # the fit is what makes the difference: the textbook set is several times further off
    textbook = planner.default_coefficients("textbook")
    assert max(abs(e) for e in peak_errors(held_out, textbook)) > 3 * max(abs(e) for e in errors)


def test_the_shipped_hf_coefficients_are_the_fit_of_the_committed_records() -> None:
    shipped = planner.default_coefficients("hf")
    entry = shipped_entry("hf")
    assert shipped.calibrated and shipped.num_records == entry["num_records"]
    for name in FITTED:
        assert getattr(shipped, name) == pytest.approx(entry[name], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b", "qwen1.5-moe-a2.7b"])
def test_committed_records_are_what_tracing_gives_today(
    records: list[TraceRecord], name: str
) -> None:
    (record,) = [r for r in records if r.model.name == name]
    measured = trace(record.model, record.train, impl="hf")
    assert record.peak is not None
    assert measured["mode"] == "fake"
    assert measured["peak"] == record.peak.model_dump()


def test_params_and_optimizer_state_trace_to_the_byte() -> None:
    model = planner.load_model("mixtral-8x7b").model_copy(update={"num_layers": 1})
    train = planner.load_train({"precision": PURE_BF16, "seq_len": 128})
    measured = trace(model, train, impl="hf")
    with torch.device("meta"):
        net = hf.build(hf.config_for(model))
    buffers = sum(b.numel() * b.element_size() for b in net.buffers())  # RoPE's inv_freq
    tensors = len(list(net.parameters()))
    n = planner.count_params(model).total
    assert measured["peak"]["params"] == 2 * n + buffers
    # fused AdamW: two moments and a 4-byte step counter per tensor, no temporaries
    assert measured["peak"]["optimizer_states"] == 4 * n + 4 * tensors
    out = compare_trace(planner.estimate(model, train, planner.gpu("H100-80GB")), measured)
    assert out["predicted"]["params"] == 2 * n


def test_specs_no_transformers_architecture_has_are_refused_naming_the_field() -> None:
    with pytest.raises(planner.SpecError) as info:
        hf.config_for(planner.load_model("tiny-moe"))  # a shared expert without qwen2_moe's gate
    assert info.value.field == "model.moe.shared_expert_gate"
    with pytest.raises(planner.SpecError) as info:  # no architecture biases o_proj alone
        hf.config_for(
            planner.load_model("llama-3-8b").model_copy(update={"attention_out_bias": True})
        )
    assert info.value.field == "model.attention_out_bias"
    with pytest.raises(planner.SpecError) as info:  # transformers builds no MTP module
        hf.config_for(planner.load_model("deepseek-v3"))
    assert info.value.field == "model.num_mtp_layers"
    with pytest.raises(planner.SpecError) as info:  # DeepSeek scales by fp32 routing weights
        deepseek = planner.load_model("deepseek-v3")
        assert deepseek.moe is not None and deepseek.moe.routing_weights_fp32
        moe = deepseek.moe.model_copy(update={"routing_weights_fp32": False})
        hf.config_for(deepseek.model_copy(update={"num_mtp_layers": 0, "moe": moe}))
    assert info.value.field == "model.moe.routing_weights_fp32"
    with pytest.raises(planner.SpecError) as info:
        hf.config_for(planner.load_model("gpt3-175b"))
    assert info.value.field == "model.ffn_kind"
    with pytest.raises(planner.SpecError) as info:
        hf.config_for(planner.load_model("llama-3-8b").model_copy(update={"num_mtp_layers": 1}))
    assert info.value.field == "model.num_mtp_layers"
    # query/key norms are Qwen3's, whose MoE model has no shared experts
    with pytest.raises(planner.SpecError) as info:
        hf.config_for(planner.load_model("tiny-moe").model_copy(update={"qk_norm": True}))
    assert info.value.field == "model.moe.num_shared_experts"


@pytest.mark.parametrize(
    ("model_type", "biases"),
    [
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # Q, K, V, O and the MLP
        ("llama", {"attention_bias": True}),
        ("mistral", {"attention_bias": True}),  # no biases, whatever the config says
        ("mixtral", {"attention_bias": True}),
        ("qwen2", {"attention_bias": False}),  # Q, K, V always
        ("qwen2_moe", {"qkv_bias": False}),
        ("qwen3", {"attention_bias": True}),  # Q, K, V, O
        ("qwen3_moe", {"attention_bias": True}),
    ],
)
def test_bias_flags_are_read_as_each_architecture_builds_them(
    model_type: str, biases: dict[str, bool]
) -> None:
    config = {
        "model_type": model_type,
        "vocab_size": 1000,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "num_local_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        **biases,
    }
    spec = planner.load_model(config)
    transformers = hf.require_transformers()
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(model_type, **fields)
        )
    assert sum(p.numel() for p in net.parameters()) == planner.count_params(spec).total
    # and a spec maps back onto an architecture that builds it
    with torch.device("meta"):
        again = hf.build(hf.config_for(spec))
    assert sum(p.numel() for p in again.parameters()) == planner.count_params(spec).total


@pytest.mark.parametrize(("model_type", "head_dim"), [("qwen3", 128), ("qwen3_moe", 64)])
def test_qwen3_configs_without_head_dim_read_as_transformers_builds_them(
    model_type: str, head_dim: int
) -> None:
    """Qwen3Config's head_dim is 128 whatever the width; Qwen3MoeConfig's is hidden / heads."""
    config = {
        "model_type": model_type,
        "vocab_size": 1000,
        "hidden_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
    }
    spec = planner.load_model(config)
    assert spec.qk_norm and spec.dim_per_head == head_dim
    with torch.device("meta"):
        net = hf.build(config)
    assert sum(p.numel() for p in net.parameters()) == planner.count_params(spec).total


def test_without_transformers_the_error_names_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(planner.SpecError) as info:
        hf.require_transformers()
    assert info.value.field == "impl" and "headroom-planner[hf]" in str(info.value)


def test_calibrate_trace_hf_from_a_config_json(tmp_path: Path) -> None:
    config = {
        "model_type": "qwen2_moe",
        "vocab_size": 2000,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/c.db"}
    args = [str(path), "--impl", "hf", "--set", "seq_len=64", "--set", "activation_profile=hf"]
    for key in ("master=none", "grads=bf16", "optimizer_states=bf16"):
        args += ["--set", f"precision.{key}"]
    proc = run_headroom("calibrate", "trace", *args, "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["impl"] == "hf" and out["trace"]["mode"] == "fake"
    assert out["error"]["params"] == pytest.approx(0, abs=1e-3)
    assert abs(out["error"]["total"]) <= 0.05
    bad = run_headroom(
        "calibrate", "trace", "tiny-moe", "--impl", "hf", *args[3:], timeout=120, env=env
    )
    assert bad.returncode == 2 and "model.moe.shared_expert_gate" in bad.stderr
    # a value only transformers judges (RoPE scaling) is refused, not a traceback
    path.write_text(json.dumps({**config, "rope_scaling": {"rope_type": "nonsense"}}))
    refused = run_headroom("calibrate", "trace", *args, timeout=120, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "config.json: transformers cannot build it" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_full_recompute_traces_transformers_checkpointing() -> None:
    """``recompute: full`` turns on transformers' per-layer checkpointing: the forward keeps the
    layers' inputs, not their activations, and the trace still runs the whole step."""
    model = planner.load_model("tiny-dense")
    transient = {}
    for recompute in ("none", "full"):
        train = planner.load_train(
            {
                "precision": PURE_BF16,
                "micro_batch_size": 2,
                "seq_len": 64,
                "recompute": recompute,
                "activation_profile": "hf",
            }
        )
        measured = trace(model, train, impl="hf")
        transient[recompute] = steady_forward_transient(measured)
        assert [p["step"] for p in measured["phases"] if p["phase"] == "optimizer"] == [1, 2]
    assert transient["full"] * 3 < transient["none"]
