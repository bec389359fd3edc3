#!/usr/bin/env bash
# Install headless Chromium and its WebDriver for the browser tests (tests/browser/).
# Idempotent: does nothing when both binaries are already present.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    SUDO=sudo
else
    SUDO=
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver

/usr/bin/chromium --version
/usr/bin/chromedriver --version
