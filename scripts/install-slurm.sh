#!/usr/bin/env bash
# Install Slurm and MUNGE from Debian's packages for the tests' one-node cluster
# (tests/slurm_cluster.py). Idempotent: does nothing when its packages are installed.
set -euo pipefail

# without dpkg the binaries are all there is to check; with it apt-install.sh checks the
# packages are configured too (an install killed part-way leaves binaries that are not)
if [[ -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd && -x /usr/sbin/munged ]] && ! command -v dpkg-query >/dev/null; then
    exit 0
fi

"$(dirname "$0")/apt-install.sh" slurm-wlm munge
/usr/sbin/slurmctld -V
