#!/usr/bin/env bash
# AIPerf (NVIDIA's load generator) in its own virtualenv, bench/.venv-aiperf, for
# bench/aiperf/run_aiperf.py. Not a dependency of pdserve: ~1.2 GB installed.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
#   bench/aiperf/setup.sh     # PYTHON=/path/to/python3 picks the interpreter (3.10+)
set -euo pipefail

AIPERF_VERSION=0.13.0
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-aiperf
stamp=$venv/.aiperf-$AIPERF_VERSION-installed

if [ -f "$stamp" ]; then
    echo "$venv: aiperf $AIPERF_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION"
"$venv/bin/aiperf" --help > /dev/null
rm -f "$venv"/.aiperf-*-installed
touch "$stamp"
du -sh "$venv"
