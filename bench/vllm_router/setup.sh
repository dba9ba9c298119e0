#!/usr/bin/env bash
# vllm-router (a Rust P/D router, PyPI wheel) in its own virtualenv, bench/.venv-vllm-router,
# for `pdserve bench routing --compare vllm-router`. Not a dependency of pdserve.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
#   bench/vllm_router/setup.sh     # PYTHON=/path/to/python3 picks the interpreter
set -euo pipefail

VLLM_ROUTER_VERSION=0.1.17
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-vllm-router
stamp=$venv/.vllm-router-$VLLM_ROUTER_VERSION-installed

if [ -f "$stamp" ]; then
    echo "$venv: vllm-router $VLLM_ROUTER_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install "vllm-router==$VLLM_ROUTER_VERSION"
"$venv/bin/vllm-router" --help > /dev/null
rm -f "$venv"/.vllm-router-*-installed
touch "$stamp"
du -sh "$venv"
