#!/usr/bin/env bash
# The HTTP property suite (tests/api/test_http_properties.py, tests/proxy/
# test_proxy_properties.py) for longer than the test suite runs it: Hypothesis' `soak`
# profile, 300 examples per property and new ones every run, against the tiny P/D cluster
# and a proxy. About 3 minutes on 2 cores. A failing example is kept in .hypothesis/ and
# replayed first next time. Extra arguments go to pytest: `bench/fuzz_http.sh -k proxy`,
# `bench/fuzz_http.sh --hypothesis-seed 7`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q --hypothesis-profile soak \
    -W ignore::hypothesis.errors.HypothesisWarning \
    tests/api/test_http_properties.py tests/proxy/test_proxy_properties.py "$@"
