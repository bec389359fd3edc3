#!/usr/bin/env bash
# Install headless Chromium and its WebDriver for the browser tests (tests/browser/).
# Idempotent: does nothing when its packages are installed.
set -euo pipefail

# without dpkg the binaries are all there is to check; with it apt-install.sh checks the
# packages are configured too (an install killed part-way leaves binaries that are not)
if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]] && ! command -v dpkg-query >/dev/null; then
    exit 0
fi

"$(dirname "$0")/apt-install.sh" chromium chromium-driver

# (Debian's launcher script prints a shell warning on hosts with much memory: not ours)
/usr/bin/chromium --version 2>/dev/null
/usr/bin/chromedriver --version
