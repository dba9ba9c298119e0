#!/usr/bin/env bash
# lm-eval (EleutherAI's harness) in its own virtualenv, bench/.venv-lm-eval, for
# `bench/lm_eval/check.py`: its `local-completions` loglikelihood against `pdserve up`.
# Not a dependency of pdserve. torch is pinned first to the local CPU build (a bare `torch`,
# which lm-eval declares, would download a CUDA build of several GB).
# Idempotent: a stamp file names the installed version.
set -euo pipefail

LM_EVAL_VERSION=0.4.13
PYTHON=${PYTHON:-python3}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=$root/bench/.venv-lm-eval
stamp=$venv/.lm-eval-$LM_EVAL_VERSION-installed

if [ -f "$stamp" ]; then
    echo "$venv: lm-eval $LM_EVAL_VERSION already installed"
    exit 0
fi
test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0
# transformers: the `huggingface` tokenizer backend of local-completions (not a default dependency).
"$venv/bin/python" -m pip install -q "lm-eval[api]==$LM_EVAL_VERSION" transformers
touch "$stamp"
