#!/usr/bin/env bash
# Install ccache, through which the tests compile C++ (tests/compilers.py): DeepSpeed's op built
# again from scratch costs a link instead of a compile. Idempotent: does nothing when it is
# installed. Without it the suite runs the same, only slower.
set -euo pipefail

if command -v ccache >/dev/null && ! command -v dpkg-query >/dev/null; then
    exit 0
fi

"$(dirname "$0")/apt-install.sh" ccache
ccache --version | head -1
