#!/usr/bin/env bash
# llama-server (llama.cpp's HTTP server: continuous batching over --parallel slots) built
# from source into bench/.llama-server, for `pdserve bench offline --compare llamacpp` with
# more than one prompt. The source is the llama.cpp that llama-cpp-python 0.3.36 vendors
# (its sdist, from PyPI), so the server runs the same llama.cpp as the binding that
# bench/llamacpp/setup.sh installs. Built with GGML_NATIVE (every ISA this CPU has), no
# web UI, no HTTPS; ~5 minutes on 2 cores. Not a dependency of pdserve.
# Idempotent: a stamp file names the built version; rerunning with it there does nothing.
#
#   bench/llamacpp/setup_server.sh     # PYTHON=/path/to/python3 runs pip download
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=$root/bench/.llama-server
# GGML_NATIVE builds for this CPU: a build from another CPU class (the checkout can move
# between machines) is rebuilt, so the stamp names the CPU's flags.
cpu=$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8)
stamp=$dir/.llama-server-$LLAMA_CPP_PYTHON_VERSION-$cpu-built

if [ -f "$stamp" ]; then
    echo "$dir/bin/llama-server: llama.cpp of llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already built"
    exit 0
fi
mkdir -p "$dir/sdist"
sdist=$dir/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
if [ ! -f "$sdist" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dir/sdist"
fi
rm -rf "$dir/src" "$dir/build"  # never reuse objects compiled for another CPU
mkdir -p "$dir/src"
tar xzf "$sdist" -C "$dir/src" --strip-components=1
cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF
cmake --build "$dir/build" --target llama-server -j "$(nproc)"
mkdir -p "$dir/bin"
cp "$dir/build/bin/llama-server" "$dir/bin/llama-server"
"$dir/bin/llama-server" --version
rm -rf "$dir/src" "$dir/build"
rm -f "$dir"/.llama-server-*-built
touch "$stamp"
du -sh "$dir"
