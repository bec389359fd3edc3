#!/usr/bin/env bash
# Install Debian packages (as root, or through sudo) without recommends: the install scripts'
# one way to apt-get. Usage: scripts/apt-install.sh PACKAGE...
# Does nothing when every package is installed and configured. An install stopped part-way (a
# killed `make test`) leaves dpkg "interrupted": it is finished first, so the next run goes on.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    SUDO=sudo
else
    SUDO=
fi

installed() {
    local status
    for package in "$@"; do
        status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$package" 2>/dev/null) || return 1
        [[ $status == "ii "* ]] || return 1
    done
}

if installed "$@"; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# wait for another apt or dpkg (its lock is released when its holder dies) instead of failing
APT=(-o DPkg::Lock::Timeout=600)
$SUDO dpkg --force-confold --configure -a
$SUDO apt-get "${APT[@]}" update
$SUDO apt-get "${APT[@]}" install -y --no-install-recommends "$@"
