"""C++ compiles of the suite through ccache, its store in this clone.

DeepSpeed's CPU op (``deepspeed_shm_comm``) is compiled from scratch in every fresh build
folder: by the test of a killed build, whose run builds into a folder of its own on purpose,
and again for the clone's cache by the first DeepSpeed test (49 s of CPU each on a 2-core VM;
the second is a hit now). torch's ``cpp_extension`` reads the compiler from ``CXX``, so ``CXX``
names a wrapper, ``g++`` by name as torch requires of a compiler on Linux, that runs ``ccache
g++``:

- the store (``CCACHE_DIR``) is under this clone's ``.venv/cache``, shared by no other clone or
  user; a run the tests start inherits both variables, so a killed build's next run compiles
  from the store the earlier run filled;
- ccache writes each result to a temporary file and renames it: a compile killed part-way
  leaves nothing half-written behind, and ccache's own locks expire when their holder is gone;
- inductor reads ``CXX`` too (``torch._inductor.config.cpp.cxx``); ccache passes its compiles
  through to g++ unchanged (they use a precompiled header, which ccache does not cache);
- without ccache (``make test`` installs it: ``scripts/install-ccache.sh``) or with ``CXX`` set
  by the user, nothing changes: the compiles run as before, only slower.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def use_ccache(cache: Path) -> Path | None:
    """Point ``CXX`` at a ``g++`` wrapper through ccache (store: ``cache/ccache``) unless the
    environment names a compiler or a store already (a run the tests start keeps its parent's);
    the wrapper, or None where ccache or g++ is missing."""
    if "CXX" in os.environ:
        return None
    ccache, gxx = shutil.which("ccache"), shutil.which("g++")
    if ccache is None or gxx is None:
        return None
    os.environ.setdefault("CCACHE_DIR", str(cache / "ccache"))
    os.environ.setdefault("CCACHE_MAXSIZE", "2G")
    wrapper = cache / "ccache-bin" / "g++"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    text = f'#!/bin/sh\nexec {ccache} {gxx} "$@"\n'
    if not wrapper.exists() or wrapper.read_text() != text:
        # each xdist worker imports this: written whole, then renamed into place
        partial = wrapper.with_name(f".g++.{os.getpid()}")
        partial.write_text(text)
        partial.chmod(0o755)
        partial.replace(wrapper)
    os.environ["CXX"] = str(wrapper)
    return wrapper
