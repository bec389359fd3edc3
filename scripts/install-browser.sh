#!/usr/bin/env bash
# Install headless Chromium and its WebDriver for the browser tests (tests/browser/).
# Idempotent: does nothing when both binaries are already present.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    exit 0
fi

"$(dirname "$0")/apt-install.sh" chromium chromium-driver

/usr/bin/chromium --version
/usr/bin/chromedriver --version
