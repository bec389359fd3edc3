"""What ``--explain`` cites is public: a paper, or a framework's file, never a document that is not
in the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from headroom import planner
from headroom.planner.explanation import explain

PACKAGE = Path(planner.__file__).resolve().parent


@pytest.mark.parametrize(
    ("model", "train"),
    [
        ("llama-3-8b", {}),
        ("llama-3-8b", {"offload": {"mode": "streaming"}}),
        ("llama-3-8b", {"offload": {"mode": "optimizer", "fraction": 0.5}, "ema": "gpu"}),
        ("qwen1.5-moe-a2.7b", {"parallel": {"dp": 4, "ep": 4}}),
        ("llama-3-8b", {"framework": "fsdp2", "parallel": {"dp": 8, "zero_stage": 3}}),
    ],
)
def test_every_bucket_cites_a_public_source(model: str, train: dict[str, object]) -> None:
    rows = explain(planner.load_model(model), planner.load_train(train), planner.gpu("H100-80GB"))
    sources = {bucket: row.source for bucket, row in rows.items()}
    for bucket, source in sources.items():
        assert source, bucket
        assert "seeds/" not in source and "DESIGN.md" not in source, (bucket, source)
        # a paper, a framework's or this repository's file, PyTorch's documentation, or a shipped
        # profile (coefficients.<name>, whose own source names the traces it was fitted to)
        public = ("arXiv:" in source, "/" in source, "PyTorch" in source)
        assert any(public) or source.startswith("coefficients."), (bucket, source)


def test_no_shipped_file_points_at_documents_outside_the_repository() -> None:
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.json")]:
        text = path.read_text(errors="replace")
        assert "seeds/" not in text and "shared/DESIGN" not in text, path
