"""The estimator's output on a fixed set of cases, for byte-identity across refactors.

Every model preset under a spread of training specs (placements, recompute, parallel layouts,
precisions, optimizers), every committed calibration record, and the auto-fit ladder on a few
presets: the budget as ``headroom estimate --format json`` prints it, each explanation's bytes,
``layer_backward_bytes`` for the records, and the ladder's choice. ``tests/planner/
test_golden_estimates.py`` holds the planner to ``data/golden-estimates.json``; regenerate it only
for an intended change of an estimate, with ``python tests/golden.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "planner" / "data" / "golden-estimates.json"

#: training specs every preset is estimated under (overrides of the defaults)
TRAIN_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "selective": {"recompute": "selective", "micro_batch_size": 2},
    "full-accum": {"recompute": "full", "grad_accum_steps": 4, "seq_len": 8192},
    "every-3": {"recompute": {"every_k": 3}, "micro_batch_size": 4},
    "zero3-dp8": {"parallel": {"dp": 8, "zero_stage": 3}, "ema": "gpu"},
    "fsdp2-tp": {
        "framework": "fsdp2",
        "activation_profile": "hf",
        "recompute": "full",
        "precision": {"grads": "fp32"},
        "parallel": {"dp": 16, "tp": 2, "zero_stage": 3, "sequence_parallel": True},
    },
    "deepspeed-z3-offload": {
        "framework": "deepspeed",
        "parallel": {"dp": 8, "zero_stage": 3},
        "offload": {"mode": "optimizer", "fraction": 0.5},
        "deepspeed": {"overlap_comm": False, "reduce_bucket_size": 50000000},
    },
    "deepspeed-z2": {"framework": "deepspeed", "parallel": {"dp": 4, "zero_stage": 2}},
    "fsdp2-torchtitan": {
        "framework": "fsdp2",
        "fsdp2": {"groups": "split"},
        "activation_profile": "torchtitan",
        "recompute": "full",
        "precision": {"grads": "fp32", "master": "fp32"},
        "parallel": {"dp": 32, "zero_stage": 3},
    },
    "torchtitan-selective-op": {
        "framework": "fsdp2",
        "fsdp2": {"groups": "split"},
        "activation_profile": "torchtitan",
        "recompute": "selective_op",
        "seq_len": 8192,
        "precision": {"grads": "fp32", "master": "fp32"},
        "parallel": {"dp": 64, "zero_stage": 3},
    },
    "selective-op": {"recompute": "selective_op", "micro_batch_size": 2},
    "fsdp2-keep": {
        "framework": "fsdp2",
        "fsdp2": {"reshard_after_forward": False},
        "parallel": {"dp": 8, "ep": 2, "zero_stage": 3},
        "grad_accum_steps": 2,
    },
    "zero1-fp32grads": {
        "parallel": {"dp": 4, "zero_stage": 1},
        "precision": {"grads": "fp32"},
        "grad_accum_steps": 2,
    },
    "tp-pp-sp": {
        "parallel": {"tp": 2, "pp": 4, "dp": 2, "sequence_parallel": True, "zero_stage": 1},
        "grad_accum_steps": 8,
    },
    "ep-cp": {"parallel": {"dp": 8, "ep": 4, "cp": 2, "zero_stage": 2}, "moe_imbalance": 1.3},
    "optimizer-offload": {"offload": {"mode": "optimizer", "fraction": 0.5}, "ema": "host"},
    "streaming": {
        "offload": {"mode": "streaming", "checkpoint_every": 2, "num_buffers": 3},
        "ema": "host",
        "max_grad_norm": 1.0,
    },
    "streaming-accum": {"offload": {"mode": "streaming"}, "grad_accum_steps": 2},
    "runtime-profile": {"activation_profile": "runtime", "attention": "eager"},
    "hf-profile": {"activation_profile": "hf", "recompute": "full", "expandable_segments": True},
    "foreach-muon": {"optimizer": "muon", "optimizer_impl": "foreach"},
    "adafactor": {"optimizer": "adafactor", "precision": {"master": "none"}},
    "adam8bit-fp16": {
        "optimizer": "adamw_8bit",
        "precision": {"params": "fp16", "grads": "fp16", "optimizer_states": "bf16"},
    },
    "sgd-capacity": {"optimizer": "sgd_momentum", "moe_capacity_factor": 2.0},
}

#: the GPU each variant is judged on, and the host RAM of its node
GPU, HOST_MEMORY, GPUS_PER_NODE = "H100-80GB", 2 * 2**40, 8

#: presets the ladder searches, with the spec it starts from
LADDER_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b-h100": ("llama-3-8b", {"micro_batch_size": 8, "seq_len": 8192}),
    "mixtral-a100": ("mixtral-8x7b", {"micro_batch_size": 4, "grad_accum_steps": 8}),
    "qwen3-30b-4090": ("qwen3-30b-a3b", {"micro_batch_size": 2, "activation_profile": "runtime"}),
    "llama-3-8b-torchtitan-h100": (
        "llama-3-8b",
        {
            "micro_batch_size": 4,
            "seq_len": 8192,
            "activation_profile": "torchtitan",
            "framework": "fsdp2",
            "fsdp2": {"groups": "split"},
            "precision": {"grads": "fp32"},
            "parallel": {"dp": 8, "zero_stage": 3},
        },
    ),
}
LADDER_GPUS = {
    "llama-3-8b-h100": "H100-80GB",
    "mixtral-a100": "A100-80GB",
    "llama-3-8b-torchtitan-h100": "H100-80GB",
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _hardware(name: str) -> Any:
    from headroom import planner

    return planner.gpu(name).model_copy(
        update={"host_memory_bytes": HOST_MEMORY, "gpus_per_node": GPUS_PER_NODE}
    )


def _budget(model: Any, train: Any, hw: Any) -> dict[str, Any]:
    from headroom import planner

    budget = planner.estimate(model, train, hw)
    out: dict[str, Any] = budget.model_dump(mode="json")
    out["explain"] = {k: e.bytes for k, e in planner.explain(model, train, hw).items()}
    return out


def _valid(model: Any, over: dict[str, Any]) -> dict[str, Any] | None:
    """``over`` adjusted to ``model`` (expert and head counts), or None where it cannot apply."""
    parallel = over.get("parallel", {})
    ep = parallel.get("ep", 1)
    if ep > 1 and (model.moe is None or model.moe.num_experts % ep):
        over = _merge(over, {"parallel": {"ep": 1}})
    tp = parallel.get("tp", 1)
    if tp > 1 and (model.num_heads % tp or (model.num_kv_heads or model.num_heads) % tp):
        return None
    pp = parallel.get("pp", 1)
    if pp > model.num_layers:
        return None
    return over


def snapshot() -> dict[str, Any]:
    """Everything the golden file holds, computed now."""
    from headroom import planner
    from headroom.planner.estimator import layer_backward_bytes

    hw = _hardware(GPU)
    presets: dict[str, Any] = {}
    for name in planner.model_names():
        model = planner.load_model(name)
        for variant, over in TRAIN_VARIANTS.items():
            adjusted = _valid(model, over)
            if adjusted is None:
                continue
            try:
                train = planner.TrainSpec.model_validate(adjusted)
                presets[f"{name}/{variant}"] = _budget(model, train, hw)
            except planner.SpecError as err:
                presets[f"{name}/{variant}"] = {"error": str(err)}
    records: dict[str, Any] = {}
    for profile in ("runtime", "hf"):
        data = json.loads((ROOT / "calibration" / "data" / f"{profile}-traces.json").read_text())
        for i, record in enumerate(data["records"]):
            model = planner.ModelSpec.model_validate(record["model"])
            train = planner.TrainSpec.model_validate(record["train"])
            out = _budget(model, train, planner.gpu(record.get("gpu", GPU)))
            out["layer_backward_bytes"] = layer_backward_bytes(model, train)
            records[f"{profile}/{i}/{model.name}"] = out
    ladder: dict[str, Any] = {}
    for case, (name, over) in LADDER_CASES.items():
        result = planner.fit(
            planner.load_model(name),
            planner.TrainSpec.model_validate(over),
            _hardware(LADDER_GPUS.get(case, "RTX-4090")),
        )
        ladder[case] = result.model_dump(mode="json")
    return {"presets": presets, "records": records, "ladder": ladder}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    if argv == ["--write"]:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    print("usage: python tests/golden.py --write", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
