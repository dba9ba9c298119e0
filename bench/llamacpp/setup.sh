#!/usr/bin/env bash
# llama.cpp through llama-cpp-python in its own virtualenv, bench/.venv-llamacpp, for
# `pdserve bench offline --compare llamacpp`. Not a dependency of pdserve. pip compiles
# llama.cpp from the sdist (~4-5 minutes on 2 cores) with GGML_NATIVE, so it uses every ISA
# this CPU has, as a user building it here would.
# Idempotent: a stamp file names the installed version; rerunning with it there does nothing.
#
# LEVEL=avx2 builds llama.cpp for the AVX2 class instead (AVX2 + FMA + F16C, no AVX-512,
# VNNI or AMX), into bench/.venv-llamacpp-avx2: `--compare llamacpp-avx2`, the peer an
# AVX2-class user runs, beside pdserve with PDSERVE_CPU_ISA=avx2 on a bigger CPU.
#
#   bench/llamacpp/setup.sh     # PYTHON=/path/to/python3.X picks the interpreter
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
PYTHON=${PYTHON:-python3}
LEVEL=${LEVEL:-native}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ "$LEVEL" = avx2 ]; then
    venv=$root/bench/.venv-llamacpp-avx2
    cpu=avx2  # the same build on every x86-64-v3 CPU
    cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
elif [ "$LEVEL" = native ]; then
    venv=$root/bench/.venv-llamacpp
    # GGML_NATIVE builds for this CPU: a build from another CPU class (the checkout can move
    # between machines) is rebuilt, so the stamp names the CPU's flags.
    cpu=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8)
    cmake_args="-DGGML_NATIVE=ON"
else
    echo "LEVEL=$LEVEL: native or avx2" >&2
    exit 2
fi
stamp=$venv/.llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-$cpu-installed

if [ -f "$stamp" ]; then
    echo "$venv: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip uninstall -y -q llama-cpp-python 2>/dev/null || true  # another CPU's build
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/python" -m pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
rm -f "$venv"/.llama-cpp-python-*-installed
touch "$stamp"
du -sh "$venv"
