"""Run presets: the training specs torchtitan and Megatron-LM ship, each with its source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from headroom import planner
from headroom.api.main import create_app
from tests.headroom_process import run_headroom


def test_every_run_preset_is_a_runnable_spec_with_its_source() -> None:
    names = planner.run_names()
    expected = {
        "torchtitan-llama3-8b",
        "torchtitan-llama3-70b",
        "torchtitan-llama3-405b",
        "torchtitan-deepseek-v3-671b",
        "megatron-gpt3-175b",
    }
    assert expected <= set(names)
    for name in names:
        run = planner.load_run(name)
        assert run.name == name
        assert run.model in planner.model_names()
        # the spec's layout uses exactly the GPUs the source names
        assert run.train.parallel.world_size == run.gpus, name
        assert run.source.startswith(("pytorch/torchtitan ", "NVIDIA/Megatron-LM ")), name
        assert "commit" in run.source
        if name.startswith("torchtitan-llama3"):  # torchtitan's own model code and groups
            assert run.train.framework == "fsdp2" and run.train.fsdp2.groups == "split"
            assert run.train.activation_profile == "torchtitan"
        elif name.startswith("torchtitan"):  # an MoE model: no torchtitan profile yet
            assert run.train.framework == "fsdp2" and run.train.activation_profile == "hf"
        planner.estimate(planner.load_model(run.model), run.train, planner.gpu(run.gpu))


@pytest.mark.parametrize("name", ["torchtitan-llama3-8b", "torchtitan-llama3-70b"])
def test_torchtitans_llama_presets_fit_the_gpus_they_ship_for(name: str) -> None:
    """torchtitan's Llama 3 presets run on 64 A100s: the estimate says they fit."""
    run = planner.load_run(name)
    budget = planner.estimate(planner.load_model(run.model), run.train, planner.gpu(run.gpu))
    assert budget.fits, budget.gpu_peak_bytes


def test_a_run_preset_is_a_train_argument_everywhere() -> None:
    run = planner.load_run("torchtitan-llama3-70b")
    expected = planner.estimate(planner.load_model(run.model), run.train, planner.gpu(run.gpu))
    assert planner.load_train("torchtitan-llama3-70b") == run.train
    proc = run_headroom(
        "estimate", run.model, "--train", run.name, "--gpu", run.gpu, "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gpu"]["peak_bytes"] == expected.gpu.peak_bytes
    listed = json.loads(run_headroom("presets", "--format", "json").stdout)["runs"]
    assert [r["name"] for r in listed] == planner.run_names()
    answer = TestClient(create_app()).get("/api/v1/presets").json()["runs"]
    assert [r["name"] for r in answer] == planner.run_names()
    with pytest.raises(planner.UnknownPresetError, match="allowed: megatron-gpt3-175b"):
        planner.load_run("torchtitan-llama4")


def test_a_file_named_like_a_run_preset_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--train NAME`` and ``load_train`` read a file of that name when one exists, the
    preset otherwise: the same rule in both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torchtitan-llama3-8b").write_text('{"seq_len": 128}')
    assert planner.load_train("torchtitan-llama3-8b").seq_len == 128
    proc = run_headroom(
        "estimate", "llama-3-8b", "--train", "torchtitan-llama3-8b", "--format", "json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plain = planner.estimate(
        planner.load_model("llama-3-8b"),
        planner.TrainSpec(seq_len=128),
        planner.gpu("H100-80GB"),
    )
    assert json.loads(proc.stdout)["gpu"]["peak_bytes"] == plain.gpu.peak_bytes
