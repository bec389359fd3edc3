"""Settings for the whole suite: nothing it builds or caches is shared with another clone or
user, and no test runs past its time limit.

- The caches that torch, triton, inductor, matplotlib and transformers keep under the user's
  home (``~/.cache/torch_extensions`` holds DeepSpeed's op and the ``lock`` a killed build
  leaves) live under ``.venv/cache`` in this clone (``HEADROOM_TEST_CACHE`` moves them: the
  test of a killed build gives its own run a fresh folder). Set before any test imports torch;
  the processes the tests start inherit them.
- Every test has a time limit (``timeout`` in pyproject.toml, ``@pytest.mark.timeout(N)`` for
  the few that need more): pytest-timeout fails it on expiry, naming it and dumping every
  thread's stack; a test that signal cannot reach is stopped a minute later, and the run with
  it (``tests/time_limits.py``).
- Whatever the session starts carries its mark and is killed once the session is gone, even
  when it is SIGKILLed, and what a killed earlier run left is killed at the start
  (``tests/processes.py``: ``guard``).
"""

from __future__ import annotations

import os
from pathlib import Path

import processes
import pytest

# every test's hard stop behind pytest-timeout (its own module: a pytest of a test's own loads
# it with ``-p time_limits``)
from time_limits import pytest_runtest_protocol  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("HEADROOM_TEST_CACHE") or ROOT / ".venv" / "cache")
#: each cache's variable and its folder under CACHE
CACHES = {
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "MPLCONFIGDIR": "matplotlib",
    "HF_HOME": "huggingface",
    "XDG_CACHE_HOME": "xdg",
}
for _variable, _folder in CACHES.items():
    os.environ[_variable] = str(CACHE / _folder)


@pytest.fixture(scope="session", autouse=True)
def _bound_processes() -> None:
    """Before any test starts a process: whatever the session starts carries its mark (the
    trainers an in-process supervisor starts too), and is killed once the session is gone,
    even when it is SIGKILLed (``processes.guard``)."""
    processes.guard()
