#!/usr/bin/env bash
# The suite under the GPU image's torch, on this CPU, before a GPU window is spent finding out:
#   bash scripts/image_torch_check.sh                  the compile, kernel (interpreted and compiled for the
#                                                      GPU: the image's Triton), golden-curve and Slurm tests
#   bash scripts/image_torch_check.sh tests/           everything the README's test command runs
#   TORCH=2.12.0 bash scripts/image_torch_check.sh     another release
#
# CI pins torch 2.13.0; the GPU machines' image has torch 2.11.0 with Triton 3.6 (docs/gpu-results.md
# names it per table). Differences found this way on 2026-11-29, each fixed and tested since: dynamo broke
# every Decoder forward at a dataclass default; nn.init.trunc_normal_ changed its method (RT's and GPN's
# weights and golden curves moved); torchrun refused --shutdown-timeout.
#
# It makes a venv of its own ($VENV, default /tmp/venv-torch<version>; about 4.6 GB, as PyPI's torch is a
# CUDA build, 2-3 minutes the first time) with this package editable and its test extras, and numpy < 2.3
# (Triton 3.6's interpreter turns 1-element arrays into scalars, which numpy 2.4 refuses). Its inductor and
# extension caches are its own. Failures of the Triton interpreter under a newer numpy are not the kernels'.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.11.0}
VENV=${VENV:-/tmp/venv-torch$TORCH}
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  echo "[image-torch] making $VENV with torch $TORCH (a CUDA build from PyPI: a few GB)"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,formats]' "numpy<2.3" 2>&1 \
    | grep -v "^WARNING: Location" || true
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    deepspeed mpi4py wheel 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -c "import torch, triton; print('[image-torch] torch', torch.__version__, 'Triton', triton.__version__)"
if [ $# -eq 0 ]; then
  set -- tests/test_compile_blocks.py tests/test_captured.py tests/test_custom_ops.py tests/test_gpn.py tests/test_rt.py \
    tests/test_delta_memory_triton.py tests/test_block_sparse_attention.py tests/test_kernel_measure.py \
    tests/test_registry.py tests/test_launch.py tests/test_slurm.py tests/test_gpu_suite.py tests/test_cuda_build.py \
    tests/test_host_syncs.py tests/test_lm_loss.py
fi
# the venv's bin first: tests that start `pretrain` or torchrun by name get this torch too
export PATH="$VENV/bin:$PATH" DS_ACCELERATOR=cpu TORCHINDUCTOR_CACHE_DIR="$VENV/inductor-cache" \
  TORCH_EXTENSIONS_DIR="$VENV/torch-extensions"
exec "$VENV/bin/python" -m pytest -m "not slow and not gpu" -q -n "${PYTEST_WORKERS:-2}" --dist loadfile \
  -p no:cacheprovider --basetemp="${TMPDIR:-/tmp}/image-torch-pytest" "$@"
