"""Trace the designs the shipped ``runtime`` and ``hf`` coefficients are fitted from, and write
them to ``calibration/data/<impl>-traces.json``.

- ``runtime``: the trainer's model, under fake tensors. The design varies width, FFN width,
  heads and KV heads, vocabulary, depth, MoE, micro-batch and sequence length: widths of 64 to
  160 at sequences up to 128, and 512 to 2048 at sequences of 512 to 2048 (those also with full
  recompute, which leaves the head's saved tensors and the logits apart from the layers' terms,
  and with a checkpoint every two layers). Each record keeps the peak inside a decoder layer's
  backward too, which the layers' backward terms are fitted to. Two shapes add Qwen3's per-head
  query/key norms (a dense one fitted, an MoE one held out), two MoE layers like the published
  ones (no shared experts; experts wider than the hidden size, or many narrower ones), and two
  whose attention is twice the hidden size wide (Qwen3's head_dim), and the hf design's three
  DeepSeek-style shapes (multi-head latent attention, fp32 routing weights; one held out), and
  three dense shapes whose FFN is 1.5, 4 and 5.5 times the hidden size (the others' is 2.75), so
  the backward's FFN-width and hidden-width terms are told apart (the 4x one held out whole).
  Every third configuration is held out, whole two-layer cuts of the GPU matrix's dense and MoE
  models, and two-layer cuts of Mixtral-8x7B and Qwen3-30B-A3B at full width and 8k-16k tokens.
- ``hf``: transformers models (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe) built from
  configs with random weights, traced under fake tensors at widths of 512 to 4096 and sequences
  of 256 to 2048. Whole shapes are held out: one of each family but qwen2 and qwen3, and
  two-layer cuts of Llama-3-8B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-8B and Qwen3-30B-A3B at
  their full widths.

bf16 working parameters throughout (the trainer's GPU precision), torch AdamW (fused, the
spec's default). Fitting uses the records not held out; the tests check the others against
the fitted estimate.

Run: .venv/bin/python -m headroom.calibration.collect [--impl runtime|hf] [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from pathlib import Path
from typing import Any

import torch

from headroom import planner
from headroom.calibration.fit import traces_path
from headroom.calibration.trace import IMPLS, layer_backward_peak, steady_forward_transient, trace
from headroom.planner.hf import from_hf_config

PURE_BF16 = {"params": "bf16", "grads": "bf16", "master": "none", "optimizer_states": "bf16"}

#: (hidden, heads, kv heads, ffn, vocab, layers, moe)
SHAPES: list[tuple[int, int, int, int, int, int, dict[str, Any] | None]] = [
    (64, 4, 2, 176, 512, 4, None),
    (128, 8, 4, 256, 1000, 2, None),
    (96, 6, 2, 320, 768, 3, None),
    (128, 4, 4, 384, 2048, 2, None),
    (64, 2, 1, 128, 4096, 2, None),
    (160, 10, 10, 448, 640, 3, None),
    (64, 4, 2, 176, 512, 2, {"num_experts": 4, "top_k": 2, "expert_ffn_size": 96}),
    (
        96,
        6,
        3,
        256,
        1024,
        2,
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 64, "num_shared_experts": 1},
    ),
]
BATCHES = [(1, 64), (2, 128), (4, 32)]
#: widths of the GPU matrix's models and its sequence lengths; the last dense and MoE shapes
#: are two-layer cuts of those models (bench/calibration_gpu.py), held out whole
LARGE_SHAPES: list[tuple[int, int, int, int, int, int, dict[str, Any] | None]] = [
    (512, 8, 4, 1408, 8000, 2, None),
    (1024, 16, 8, 2816, 16000, 3, None),
    (512, 8, 4, 1408, 8000, 2, {"num_experts": 8, "top_k": 2, "expert_ffn_size": 352}),
    (
        1024,
        16,
        8,
        2816,
        16000,
        2,
        {"num_experts": 16, "top_k": 4, "expert_ffn_size": 512, "num_shared_experts": 1},
    ),
    (2048, 16, 8, 5632, 32000, 2, None),
    (
        2048,
        16,
        8,
        5632,
        32000,
        2,
        {"num_experts": 8, "top_k": 2, "expert_ffn_size": 1408, "num_shared_experts": 1},
    ),
]
LARGE_BATCHES = [(1, 2048), (2, 512), (4, 1024)]
HELD_OUT_LARGE = 2  # the last two large shapes
#: large shapes again with per-head query/key norms (qk_norm): (index, held out whole)
QK_NORM_SHAPES = [(1, False), (3, True)]
#: MoE layers without shared experts, as the published ones: experts wider than the hidden
#: size (Mixtral's) and many narrower ones (Qwen3-MoE's), fitted
MOE_SHAPES: list[tuple[int, int, int, int, int, int, dict[str, Any] | None]] = [
    (1024, 8, 2, 2816, 16000, 2, {"num_experts": 8, "top_k": 2, "expert_ffn_size": 3584}),
    (1024, 16, 4, 2816, 16000, 2, {"num_experts": 64, "top_k": 8, "expert_ffn_size": 384}),
]
#: attention wider than the hidden size (heads x head_dim = 2 x hidden, as Qwen3's): a dense and
#: an MoE shape, fitted, so the attention terms are told apart from the hidden-width ones
WIDE_ATTENTION_SHAPES = [LARGE_SHAPES[1], MOE_SHAPES[1]]
#: dense layers whose FFN is narrower (1.5x) and wider (5.5x, as Qwen2's) than the other dense
#: shapes' 2.75x, so the backward's FFN-width and hidden-width terms are told apart: two
#: fitted (every third configuration held out), a third between them held out whole
FFN_RATIO_SHAPES: list[tuple[tuple[int, int, int, int, int, int, None], bool]] = [
    ((1024, 16, 8, 1536, 16000, 2, None), False),
    ((1024, 16, 8, 5632, 16000, 2, None), False),
    ((1536, 12, 4, 6144, 24000, 2, None), True),
]
#: published MoE models at full width, cut to two layers, held out: (name, batch, seq, recompute)
RUNTIME_PRESETS = [
    ("mixtral-8x7b", 2, 4096, "none"),
    ("qwen3-30b-a3b", 4, 4096, "none"),
    ("qwen3-30b-a3b", 4, 4096, "full"),
]

#: hf design: (family, hidden, heads, kv heads, ffn, vocab, layers, tied, moe, held out)
HF_SHAPES: list[tuple[str, int, int, int, int, int, int, bool, dict[str, Any] | None, bool]] = [
    ("llama", 512, 8, 2, 1408, 8000, 2, False, None, False),
    ("llama", 1024, 16, 8, 2816, 32000, 2, False, None, False),
    ("llama", 2048, 16, 4, 5632, 16000, 2, True, None, False),
    ("llama", 768, 12, 12, 2048, 50000, 3, False, None, True),
    ("qwen2", 896, 14, 2, 4864, 20000, 2, True, None, False),
    ("mixtral", 512, 8, 2, 1024, 8000, 2, False, {"num_experts": 8, "top_k": 2}, False),
    ("mixtral", 1024, 16, 8, 2048, 16000, 2, False, {"num_experts": 4, "top_k": 1}, False),
    ("mixtral", 768, 12, 4, 1536, 12000, 2, False, {"num_experts": 8, "top_k": 2}, True),
    (
        "qwen2_moe",
        512,
        8,
        8,
        1024,
        10000,
        2,
        False,
        {"num_experts": 16, "top_k": 4, "expert_ffn_size": 256, "shared": 1024},
        False,
    ),
    (
        "qwen2_moe",
        1024,
        16,
        16,
        2048,
        24000,
        2,
        False,
        {"num_experts": 30, "top_k": 4, "expert_ffn_size": 512, "shared": 2048},
        False,
    ),
    (
        "qwen2_moe",
        768,
        12,
        12,
        2048,
        16000,
        2,
        False,
        {"num_experts": 20, "top_k": 4, "expert_ffn_size": 384, "shared": 1536},
        True,
    ),
    ("qwen3", 1024, 16, 4, 3072, 24000, 2, False, None, False),
    (
        "qwen3_moe",
        640,
        10,
        2,
        1792,
        14000,
        2,
        False,
        {"num_experts": 16, "top_k": 4, "expert_ffn_size": 384},
        False,
    ),
]
#: hf design, DeepSeek-V3's multi-head latent attention (config.json keys; one routing group):
#: (config, held out). Its values are narrower than its queries and keys, which a GPU runs in
#: the memory-efficient kernel (the trace does the same, calibration.trace)
_MLA = {"model_type": "deepseek_v3", "hidden_act": "silu", "qk_nope_head_dim": 64}
HF_MLA_SHAPES: list[tuple[dict[str, Any], bool]] = [
    (
        {
            **_MLA, "hidden_size": 1024, "num_attention_heads": 8, "q_lora_rank": 384,
            "kv_lora_rank": 256, "qk_rope_head_dim": 32, "v_head_dim": 64,
            "intermediate_size": 2816, "vocab_size": 16000, "num_hidden_layers": 3,
            "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 512, "n_shared_experts": 1, "topk_method": "noaux_tc",
        },
        False,
    ),
    (  # no query compression (DeepSeek-V2-Lite's), dense
        {
            **_MLA, "hidden_size": 768, "num_attention_heads": 12, "q_lora_rank": None,
            "kv_lora_rank": 256, "qk_rope_head_dim": 32, "v_head_dim": 64,
            "intermediate_size": 2048, "vocab_size": 11000, "num_hidden_layers": 2,
            "first_k_dense_replace": 2, "n_routed_experts": 0,
        },
        False,
    ),
    (
        {
            **_MLA, "hidden_size": 896, "num_attention_heads": 14, "q_lora_rank": 448,
            "kv_lora_rank": 192, "qk_rope_head_dim": 32, "v_head_dim": 64,
            "intermediate_size": 2432, "vocab_size": 18000, "num_hidden_layers": 3,
            "first_k_dense_replace": 1, "n_routed_experts": 32, "num_experts_per_tok": 6,
            "moe_intermediate_size": 256, "n_shared_experts": 2, "topk_method": "noaux_tc",
        },
        True,
    ),
]  # fmt: skip
HF_BATCHES = [(1, 512), (2, 1024), (4, 256)]
#: full-width published models cut to two layers, held out
HF_PRESETS = [
    ("llama-3-8b", 1, 1024),
    ("mixtral-8x7b", 1, 1024),
    ("qwen1.5-moe-a2.7b", 2, 512),
    ("qwen3-8b", 2, 1024),
    ("qwen3-30b-a3b", 1, 2048),
]
#: DeepSeek-V3 at full width (deepseek_cut), held out: (batch, seq, recompute) of its hf traces
HF_DEEPSEEK_RUNS = [(1, 1024, "none"), (1, 2048, "full")]


def deepseek_cut() -> planner.ModelSpec:
    """DeepSeek-V3 at full width cut to its three dense layers and first MoE layer, without the
    multi-token-prediction module (transformers builds none; the planner reports it apart)."""
    return planner.load_model("deepseek-v3").model_copy(
        update={"num_layers": 4, "num_mtp_layers": 0}
    )


def _train(mb: int, seq: int, profile: str, recompute: Any = "none") -> planner.TrainSpec:
    return planner.TrainSpec.model_validate(
        {
            "micro_batch_size": mb,
            "seq_len": seq,
            "recompute": recompute,
            "precision": PURE_BF16,
            "activation_profile": profile,
        }
    )


def _hf_spec(shape: tuple[Any, ...], index: int) -> planner.ModelSpec:
    family, hidden, heads, kv, ffn, vocab, layers, tied, moe, _ = shape
    config: dict[str, Any] = {
        "model_type": family,
        "_name_or_path": f"hf-trace-{index}",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
    }
    if family in ("qwen3", "qwen3_moe"):
        config["head_dim"] = hidden // heads
    if family == "mixtral":
        config.update(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"])
    elif family == "qwen3_moe":
        config.update(
            num_experts=moe["num_experts"],
            num_experts_per_tok=moe["top_k"],
            moe_intermediate_size=moe["expert_ffn_size"],
        )
    elif family == "qwen2_moe":
        config.update(
            num_experts=moe["num_experts"],
            num_experts_per_tok=moe["top_k"],
            moe_intermediate_size=moe["expert_ffn_size"],
            shared_expert_intermediate_size=moe["shared"],
        )
    spec = from_hf_config(config)
    return spec.model_copy(update={"source": "calibration design (calibration/collect.py)"})


def design(impl: str = "runtime") -> list[tuple[planner.ModelSpec, planner.TrainSpec, bool]]:
    """(model, train, held out) of every configuration ``impl``'s design traces."""
    if impl == "hf":
        out = []
        for i, shape in enumerate(HF_SHAPES):
            model = _hf_spec(shape, i)
            out += [(model, _train(mb, seq, "hf"), shape[-1]) for mb, seq in HF_BATCHES]
        for i, (config, held_out) in enumerate(HF_MLA_SHAPES):
            model = _mla_spec(config, f"hf-trace-mla-{i}")
            out += [(model, _train(mb, seq, "hf"), held_out) for mb, seq in HF_BATCHES]
            # full recompute: transformers keeps each layer's input only
            out.append((model, _train(2, 1024, "hf", "full"), held_out))
        for name, mb, seq in HF_PRESETS:
            model = planner.load_model(name).model_copy(update={"num_layers": 2})
            out.append((model, _train(mb, seq, "hf"), True))
        model = deepseek_cut()
        out += [(model, _train(mb, seq, "hf", rc), True) for mb, seq, rc in HF_DEEPSEEK_RUNS]
        return out
    out = []
    shapes = [(shape, BATCHES, False) for shape in SHAPES]
    shapes += [
        (shape, LARGE_BATCHES, i >= len(LARGE_SHAPES) - HELD_OUT_LARGE)
        for i, shape in enumerate(LARGE_SHAPES)
    ]
    for i, (dims, batches, whole) in enumerate(shapes):
        model = _runtime_spec(dims, f"trace-{i}")
        for mb, seq in batches:
            out.append((model, _train(mb, seq, "runtime"), whole or len(out) % 3 == 2))
        if batches is LARGE_BATCHES:
            # full recompute: the layers keep their inputs only, so the head's saved tensors
            # and the logits stand apart from the layers' terms
            mb, seq = batches[0]
            out.append((model, _train(mb, seq, "runtime", "full"), whole or len(out) % 3 == 2))
            # a checkpoint every two layers: the recomputed block's backward holds both
            mb, seq = batches[2]
            every_2 = _train(mb, seq, "runtime", {"every_k": 2})
            out.append((model, every_2, whole or len(out) % 3 == 2))
    for index, whole in QK_NORM_SHAPES:
        model = _runtime_spec(LARGE_SHAPES[index], f"trace-qk-{index}", qk_norm=True)
        for mb, seq in LARGE_BATCHES:
            out.append((model, _train(mb, seq, "runtime"), whole or len(out) % 3 == 2))
    for index, dims in enumerate(MOE_SHAPES):
        model = _runtime_spec(dims, f"trace-moe-{index}")
        for mb, seq in LARGE_BATCHES:
            out.append((model, _train(mb, seq, "runtime"), len(out) % 3 == 2))
    for index, dims in enumerate(WIDE_ATTENTION_SHAPES):
        model = _runtime_spec(dims, f"trace-attn-{index}", head_dim=2 * dims[0] // dims[1])
        for mb, seq in LARGE_BATCHES:
            out.append((model, _train(mb, seq, "runtime"), len(out) % 3 == 2))
    # multi-head latent attention with fp32 routing weights (the hf design's DeepSeek shapes),
    # the third held out whole: its attention's and routing's terms fitted, not only checked
    for i, (config, held_out) in enumerate(HF_MLA_SHAPES):
        model = _mla_spec(config, f"trace-mla-{i}")
        runs = [_train(mb, seq, "runtime") for mb, seq in HF_BATCHES]
        for train in [*runs, _train(2, 1024, "runtime", "full")]:
            out.append((model, train, held_out or len(out) % 3 == 2))
    for name, mb, seq, recompute in RUNTIME_PRESETS:
        model = planner.load_model(name).model_copy(update={"num_layers": 2})
        out.append((model, _train(mb, seq, "runtime", recompute), True))
    # DeepSeek-V3's three dense layers and first MoE layer at full width: multi-head latent
    # attention and fp32 routing weights, held out
    out.append((deepseek_cut(), _train(1, 2048, "runtime"), True))
    for index, (dims, whole) in enumerate(FFN_RATIO_SHAPES):
        model = _runtime_spec(dims, f"trace-ffn-{index}")
        runs = [_train(mb, seq, "runtime") for mb, seq in LARGE_BATCHES]
        for train in [*runs, _train(4, 1024, "runtime", {"every_k": 2})]:
            out.append((model, train, whole or len(out) % 3 == 2))
    return out


def _mla_spec(config: dict[str, Any], name: str) -> planner.ModelSpec:
    """One of ``HF_MLA_SHAPES``' configs as the planner reads it, named ``name``."""
    return from_hf_config({**config, "_name_or_path": name}).model_copy(
        update={"source": "calibration design (calibration/collect.py)"}
    )


def _runtime_spec(
    shape: tuple[int, int, int, int, int, int, dict[str, Any] | None], name: str, **extra: Any
) -> planner.ModelSpec:
    """The trainer's model family (tiny-dense's choices) at ``shape``."""
    hidden, heads, kv, ffn, vocab, layers, moe = shape
    return planner.ModelSpec.model_validate(
        {
            **planner.load_model("tiny-dense").model_dump(),
            "name": name,
            "hidden_size": hidden,
            "num_heads": heads,
            "num_kv_heads": kv,
            "ffn_hidden_size": ffn,
            "vocab_size": vocab,
            "num_layers": layers,
            "moe": moe,
            "source": "calibration design (calibration/collect.py)",
            **extra,
        }
    )


def record(
    model: planner.ModelSpec, train: planner.TrainSpec, held_out: bool, impl: str = "runtime"
) -> dict[str, Any]:
    measured = trace(model, train, impl=impl)
    return {
        "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"),
        "held_out": held_out,
        "mode": measured["mode"],
        "forward_transient_bytes": steady_forward_transient(measured),
        "peak_bytes": measured["peak"]["total"],
        "layer_backward_peak_bytes": layer_backward_peak(measured),
        "peak": measured["peak"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=IMPLS, default="runtime")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    output = args.output or traces_path(args.impl)
    torch.set_num_threads(1)
    records = [record(m, t, h, args.impl) for m, t, h in design(args.impl)]
    payload: dict[str, Any] = {
        "about": f"Traced training steps ({args.impl} implementation, calibration/trace.py); "
        f"the shipped '{args.impl}' coefficients are fitted from the records not held out.",
        "command": f"python -m headroom.calibration.collect --impl {args.impl}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "created": dt.datetime.now(dt.UTC).date().isoformat(),
        "records": records,
    }
    if args.impl == "hf":
        import transformers

        payload["transformers"] = transformers.__version__
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(records)} records → {output}")


if __name__ == "__main__":
    main()
