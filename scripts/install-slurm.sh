#!/usr/bin/env bash
# Install Slurm and MUNGE from Debian's packages for the tests' one-node cluster
# (tests/slurm_cluster.py). Idempotent: does nothing when the daemons are already present.
set -euo pipefail

if [[ -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd && -x /usr/sbin/munged ]]; then
    exit 0
fi

"$(dirname "$0")/apt-install.sh" slurm-wlm munge
/usr/sbin/slurmctld -V
