"""The suite's C++ compiles go through ccache with its store in this clone (``tests/compilers.py``):
the same source compiled again in a fresh folder, as the killed build's test compiles DeepSpeed's
op, is a hit; a compiler or a store the environment names is left alone."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import compilers
import pytest

SOURCE = "#include <vector>\nint twice(int x) { return 2 * x; }\n"


def _stats(env: dict[str, str]) -> dict[str, int]:
    out = subprocess.run(
        ["ccache", "--print-stats"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines()) if v.isdigit()}


def test_a_second_compile_in_a_fresh_folder_is_a_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("ccache") is None:
        pytest.skip("ccache is not installed: scripts/install-ccache.sh (make test runs it)")
    for name in ("CXX", "CCACHE_DIR", "CCACHE_MAXSIZE"):
        monkeypatch.delenv(name, raising=False)
    wrapper = compilers.use_ccache(tmp_path / "cache")
    assert wrapper is not None and wrapper.name == "g++"  # torch takes a compiler by its name
    assert os.environ["CXX"] == str(wrapper)
    assert os.environ["CCACHE_DIR"] == str(tmp_path / "cache" / "ccache")
    env = dict(os.environ)
    for build in ("first", "second"):  # as torch's ninja compiles an op in its build folder
        folder = tmp_path / build
        folder.mkdir()
        (folder / "op.cpp").write_text(SOURCE)
        subprocess.run(
            [str(wrapper), "-MMD", "-MF", "op.o.d", "-fPIC", "-O2", "-c", "op.cpp", "-o", "op.o"],
            cwd=folder,
            env=env,
            check=True,
        )
        assert (folder / "op.o").stat().st_size > 0
    stats = _stats(env)
    assert stats["direct_cache_hit"] + stats.get("preprocessed_cache_hit", 0) == 1, stats
    assert stats["cache_miss"] == 1, stats
    # written once: a second call (another xdist worker) finds CXX set and changes nothing
    assert compilers.use_ccache(tmp_path / "elsewhere") is None
    assert not (tmp_path / "elsewhere").exists()


def test_a_compiler_the_environment_names_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", "clang++")
    assert compilers.use_ccache(tmp_path) is None
    assert os.environ["CXX"] == "clang++"
    assert not any(tmp_path.iterdir())
