#!/usr/bin/env bash
# llama.cpp through llama-cpp-python in its own virtualenv, bench/.venv-llamacpp, for
# `pdserve bench offline --compare llamacpp`. Not a dependency of pdserve. pip compiles
# llama.cpp from the sdist (~4-5 minutes on 2 cores) with GGML_NATIVE, so it uses every ISA
# this CPU has, as a user building it here would.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
#   bench/llamacpp/setup.sh     # PYTHON=/path/to/python3.X picks the interpreter
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-llamacpp
# GGML_NATIVE builds for this CPU: a build from another CPU class (the checkout can move
# between machines) is rebuilt, so the stamp names the CPU's flags.
cpu=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8)
stamp=$venv/.llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-$cpu-installed

if [ -f "$stamp" ]; then
    echo "$venv: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip uninstall -y -q llama-cpp-python 2>/dev/null || true  # another CPU's build
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/python" -m pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
rm -f "$venv"/.llama-cpp-python-*-installed
touch "$stamp"
du -sh "$venv"
