"""``headroom.hooks.MemoryReporter``: a training loop's measured memory back to a served Headroom.

End to end on the CPU: the bundled trainer, hooked, under its simulated device, posts its record
to ``headroom serve``; ``calibrate fit`` takes it in; the next ``estimate --calibrated`` of that
stack names its trust and margin from it. A service that dies mid-run fails nothing: the record
waits on disk and is sent later."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import processes
import pytest
import torch
from headroom_process import run_headroom, serve_headroom

from headroom import planner
from headroom.calibration.trust import assess
from headroom.hooks import MemoryReporter, send_pending
from headroom.runtime.cap import DeviceCap
from headroom.runtime.trainer import RunConfig, train_model

TOKEN = "hook-token"
TRAIN = {"micro_batch_size": 2, "seq_len": 32, "activation_profile": "runtime"}
SPEC = {"model": "tiny-dense", "train": TRAIN, "gpu": "H100-80GB"}


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path / 'headroom.db'}",
        "HEADROOM_TOKEN": TOKEN,
        "HEADROOM_RUN_DIR": str(tmp_path / "runs"),
        "HEADROOM_LAUNCH_RUNS": "false",
    }


def _train(hook: Any, steps: int = 3) -> None:
    model = planner.load_model("tiny-dense")
    train = planner.load_train(TRAIN)
    with DeviceCap(1 << 34):
        train_model(model, train, RunConfig(steps=steps, dtype=torch.bfloat16), hook)


def test_a_hooked_run_calibrates_its_stack_end_to_end(tmp_path: Path) -> None:
    env = _env(tmp_path)
    with serve_headroom(env, tmp_path / "serve.log") as served:
        reporter = MemoryReporter(served.url, "hooked-run-1", SPEC, token=TOKEN, spool=tmp_path)
        _train(reporter)
    assert reporter.sent is not None and reporter.sent["uid"] == "hooked-run-1", reporter.sent
    stored = reporter.sent
    assert stored["source"] == "external" and stored["model_name"] == "tiny-dense"
    # the largest allocated peak of the phases read, in the estimate's phase names
    peaks = [p["allocated_bytes"] for p in reporter.phases]
    assert stored["measured_peak_bytes"] == max(peaks)
    assert {p["phase"] for p in reporter.phases} >= {"step1_forward", "backward", "optimizer"}
    assert stored["measured"]["phase"] in planner.budget.PHASES
    full_env = {**os.environ, **env}
    fit = run_headroom("calibrate", "fit", "--profile", "runtime", "--format", "json", env=full_env)
    assert fit.returncode == 0, fit.stderr
    assert json.loads(fit.stdout)["fitted"][0]["profile"] == "runtime"
    spec_file = tmp_path / "train.json"
    spec_file.write_text(json.dumps(TRAIN))
    args = ["estimate", "tiny-dense", "--train", str(spec_file), "--calibrated"]
    estimate = run_headroom(*args, "--format", "json", env=full_env)
    assert estimate.returncode == 0, estimate.stderr
    coeffs = json.loads(estimate.stdout)["coefficients"]
    # its trust and margin come from the one record the hooked run made
    assert coeffs["recent_records"] == 1
    expected = assess(planner.Coefficients.model_validate(coeffs), [stored["relative_error"]])
    assert coeffs["margin_fraction"] == pytest.approx(expected.margin_fraction)
    assert "1 recent measurement" in coeffs["source"]
    # and the gate judges with the same coefficients and the margin that trust sets
    gate = run_headroom("gate", *args[1:], "--format", "json", env=full_env)
    assert gate.returncode == 0, gate.stderr
    verdict = json.loads(gate.stdout)
    assert verdict["calibrated"] and verdict["decision"] == "fits"
    assert verdict["margin_bytes"] == json.loads(estimate.stdout)["margin_bytes"]
    said = run_headroom("gate", *args[1:], env=full_env)
    assert "1 recent measurement" in said.stdout, said.stdout
    # a profile with no calibrated coefficients cannot be judged so: undecided, exit 3
    textbook = run_headroom(
        "gate", *args[1:], "--set", "activation_profile=textbook", "--format", "json", env=full_env
    )
    assert textbook.returncode == 3 and json.loads(textbook.stdout)["decision"] == "undecided"


def test_a_service_that_dies_mid_run_fails_nothing_and_the_record_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = _env(tmp_path)
    spool = tmp_path / "pending"
    with serve_headroom(env, tmp_path / "serve.log") as served:
        reporter = MemoryReporter(served.url, "orphan-run", SPEC, token=TOKEN, spool=spool)

        def hook(phase: str, step: int) -> None:
            if (phase, step) == ("forward", 2):
                processes.stop(served.process, grace_s=10)  # the service dies mid-run
            reporter(phase, step)

        with caplog.at_level(logging.WARNING, logger="headroom.hooks"):
            _train(hook, steps=4)  # trains to its end: nothing raised into the loop
    assert reporter.sent == {"kept": str(spool / "orphan-run.json")}
    warnings = [r for r in caplog.records if r.name == "headroom.hooks"]
    assert len(warnings) == 1 and "did not take the record" in warnings[0].getMessage()
    with serve_headroom(env, tmp_path / "serve2.log") as served:
        assert send_pending(served.url, TOKEN, spool) == ["orphan-run"]
        assert not list(spool.glob("*.json"))
        listed = run_headroom("calibrate", "report", "--format", "json", env={**os.environ, **env})
        assert listed.returncode == 0


def test_the_hook_never_raises_and_writes_to_a_file(tmp_path: Path) -> None:
    def broken() -> dict[str, int]:
        raise RuntimeError("no counters today")

    reporter = MemoryReporter(tmp_path / "out", "r1", SPEC, stats=broken)
    reporter.phase("forward", 1)  # logged, not raised
    assert reporter.sent is None
    reads = iter([{"allocated_bytes": 5}, {"allocated_bytes": 9}, {"allocated_bytes": 7}] * 2)
    writer = MemoryReporter(str(tmp_path / "out") + "/", "r2", SPEC, stats=lambda: next(reads))
    for step in (1, 2):
        for phase in ("forward", "backward", "optimizer"):
            writer.phase(phase, step)
    body = json.loads((tmp_path / "out" / "r2.json").read_text())
    assert body["measured"] == {"allocated_bytes": 9, "phase": "step1_backward"}
    assert body["uid"] == "r2" and body["model"] == "tiny-dense"
    writer.phase("forward", 3)  # reported once: later phases are not read
    assert len(writer.phases) == 6


def _two_steps_marked(reporter: MemoryReporter, written: Path) -> None:
    """A callback's reporter read the first two steps' backward and optimizer step (the first
    step's backward named as its own phase), and wrote their largest allocated peak."""
    assert [(p["phase"], p["step"]) for p in reporter.phases] == [
        ("step1_backward", 1),
        ("optimizer", 1),
        ("backward", 2),
        ("optimizer", 2),
    ]
    body = json.loads(written.read_text())
    assert body["measured"]["allocated_bytes"] == max(p["allocated_bytes"] for p in reporter.phases)


def test_the_hf_trainer_callback_marks_each_steps_phases(tmp_path: Path) -> None:
    import transformers

    from headroom.hooks.integrations import hf_trainer_callback

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (8, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    reporter = MemoryReporter(tmp_path / "hf.json", "hf-run", SPEC)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[hf_trainer_callback(reporter)]
    )
    with DeviceCap(1 << 34):  # the simulated device counts the HF run's storages
        trainer.train()
    _two_steps_marked(reporter, tmp_path / "hf.json")


def test_the_lightning_callback_marks_each_steps_phases(tmp_path: Path) -> None:
    import lightning

    from headroom.hooks.integrations import lightning_callback

    class Tiny(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
            )

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32), torch.randint(0, 8, (8,)))
    reporter = MemoryReporter(tmp_path / "lightning.json", "lightning-run", SPEC)
    trainer = lightning.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning_callback(reporter)],
        default_root_dir=str(tmp_path),
    )
    with DeviceCap(1 << 34):
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
    _two_steps_marked(reporter, tmp_path / "lightning.json")
