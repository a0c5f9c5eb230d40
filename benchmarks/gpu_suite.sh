#!/usr/bin/env bash
# The GPU suite on a GPU machine (benchmarks/gpu_suite.py --help): carried wheels (.whl: omegaconf and
# antlr4, which the device image lacks) are installed to /tmp/site first when there are any.
set -e; cd "$(dirname "$0")/.."; if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PYTHONPATH; fi; PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 exec python3 benchmarks/gpu_suite.py "$@"
