#!/usr/bin/env bash
# Creates .venv (or the folder in $VENV) with the CPU build of torch 2.13.0 and this package installed
# in editable mode with its test and input-format extras. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# torch first and pinned: an unpinned torch requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,formats]' 2>&1 | grep -v "^WARNING: Location" || true
# Parallel engines: DeepSpeed is a source package; without build isolation and with its ops left to
# JIT, it builds against the torch above instead of pulling its own. mpi4py for MPI starts.
if [ "${SKIP_PARALLEL:-0}" != 1 ]; then
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    deepspeed mpi4py 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -c "import torch, numpy, sentencepiece, data_tools; print('[setup] ok: torch', torch.__version__)"
if ! "$VENV/bin/python" -c "import sys; from pretrain.malloc import find_caching_allocator as f; sys.exit(f() is None)"; then
  echo "[setup] note: no tcmalloc/jemalloc found; \`apt-get install libtcmalloc-minimal4\` makes CPU training ~15% faster (pretrain/malloc.py)"
fi
