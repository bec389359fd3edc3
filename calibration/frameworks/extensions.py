"""C++ ops that a framework builds on first use, built so that a killed build never blocks the
next one.

DeepSpeed on the CPU builds its shared-memory communication op (``deepspeed_shm_comm``) with
ninja the first time a process group starts, through ``torch.utils.cpp_extension.load``. That
guards the op's build folder with a ``lock`` file (``torch.utils.file_baton.FileBaton``): created
with ``O_EXCL``, removed when the build ends, and waited on, forever, by every other process
that finds it. A process killed mid-build leaves the file, and every later process that loads
the op, from any clone sharing the folder (``~/.cache/torch_extensions`` by default), hangs
without a word.

Here every load of such an op in this project goes through :func:`load_op`:

- it holds an exclusive ``flock`` on ``<build root>/.headroom-build.lock`` while it builds or
  loads; the kernel drops the ``flock`` when its holder dies, so it can never go stale;
- holding it, a torch ``lock`` file in the op's folder can only be a dead build's (every
  builder in this project goes through the ``flock``): it is removed with the folder's
  half-built objects, and the op is built again from scratch;
- the build root is ``TORCH_EXTENSIONS_DIR`` when set (the tests set it inside the clone), so
  nothing is shared with other clones or users.

Needs torch (and DeepSpeed for its ops).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: how long a process waits for another live process's build of the same op
BUILD_WAIT_S = 900.0
_LOCK_NAME = ".headroom-build.lock"


class BuildLockTimeout(RuntimeError):
    """Another live process held the build lock longer than :data:`BUILD_WAIT_S`."""


def build_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else torch's default (a folder
    per Python and accelerator under the user's cache), as ``cpp_extension`` derives it."""
    import sys

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


@contextlib.contextmanager
def build_lock(root: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``root`` (made if missing), waiting at most ``wait_s``
    for a live holder; the kernel releases it if this process dies."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildLockTimeout(
                        f"another process has held {root / _LOCK_NAME} for over {wait_s:.0f} s "
                        "(a build still running?)"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def clear_stale_build(folder: Path) -> bool:
    """Remove ``folder`` (an op's build folder) if a dead build's torch ``lock`` is in it.

    Call only while holding :func:`build_lock` of its root: then no live build of this project
    holds that lock. The folder goes whole: a build killed mid-compile can leave truncated
    objects that ninja would take as built."""
    lock = folder / "lock"
    if not lock.exists():
        return False
    log.warning("removing %s, left by a build that was killed; the op is built again", folder)
    shutil.rmtree(folder, ignore_errors=True)
    return True


def load_op(name: str, load: Callable[[], Any]) -> Any:
    """``load()`` (which builds op ``name`` on first use, as torch's ``cpp_extension.load``
    does) under the build lock, after clearing a killed build of it."""
    root = build_root()
    with build_lock(root):
        clear_stale_build(root / name)
        return load()


def load_deepspeed_shm_comm() -> Any:
    """DeepSpeed's CPU shared-memory communication op, built if needed. Loaded into DeepSpeed's
    own cache of ops, so ``deepspeed.init_distributed`` later in this process finds it loaded
    and never builds (or waits on a lock) itself. None where DeepSpeed cannot build it here."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return load_op(builder.NAME, builder.load)
