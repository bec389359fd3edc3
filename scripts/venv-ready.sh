#!/bin/sh
# Make a virtualenv ready for the Makefile's installs, and mark them begun.
#
# It is made (again) when it is missing, when its creation was stopped part-way (a python but
# no pip), and when an install into it was stopped part-way: a Ctrl-C or a job's end during
# `pip install` can leave a package whose metadata is in but whose files or console scripts
# are not (mypy's dist-info without .venv/bin/mypy), which every later pip calls installed, so
# every later `make test` failed at once. The mark (VENV/.installing) says an install has
# begun; the Makefile removes it when its installs are through.
#
# usage: scripts/venv-ready.sh VENV [PYTHON]
set -eu
venv=${1:?usage: venv-ready.sh VENV [PYTHON]}
python=${2:-python3}
if [ -e "$venv/.installing" ]; then
    echo "an install into $venv was stopped part-way: making $venv again" >&2
    rm -rf "$venv"
fi
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
touch "$venv/.installing"
"$venv/bin/python" -m pip install --quiet --upgrade pip
