#!/usr/bin/env bash
# Install Debian packages (as root, or through sudo) without recommends: the install scripts'
# one way to apt-get. Usage: scripts/apt-install.sh PACKAGE...
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    SUDO=sudo
else
    SUDO=
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "$@"
