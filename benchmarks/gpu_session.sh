#!/usr/bin/env bash
# One device call's worth of GPU work, prepared (GPU time comes in ~15-minute windows, each machine start
# costing 1-2 of them): the suite's part $1 (default transformer), a torch.profiler capture of
# baseline/s without masks (serial: of RT with graphs, PROFILE_ROW picks another, and bench_rt_layer.py's
# per-layer table), and the gpu-marked tests. About 9 minutes; each stage has its own timeout,
# so one slow stage cannot take the rest. Results go to $OUT (default ./gpu_out) as at most 8 files:
# suite.log, suite_<part>.md/.json, profile_*.txt, gpu_tests.log, logs.tgz (every run's log).
#     bash benchmarks/gpu_session.sh transformer      # run the suite before and after a change
#     DRY=1 bash benchmarks/gpu_session.sh all        # rehearse it on a CPU (tiny shapes; the gpu tests skip)
set -u; cd "$(dirname "$0")/.."; OUT=${OUT:-gpu_out}; PART=${1:-transformer}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # the device image lacks omegaconf and antlr4: carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
timeout "${SUITE_S:-330}" python3 benchmarks/gpu_suite.py --part "$PART" --out /tmp/suite --cap "${CAP_S:-80}" ${DRY:+--dry-run} \
  --commit "${COMMIT:-}" > "$OUT/suite.log" 2>&1; echo "suite: rc $?"
cp /tmp/suite/suite_"$PART".* "$OUT"/ 2>/dev/null
[ "$PART" = serial ] && ROW=${PROFILE_ROW:-rt/300m-12l graphs} || ROW=${PROFILE_ROW:-baseline/s no-mask}
[ "$PART" = serial ] && PPART=serial || PPART=transformer
timeout "${PROFILE_S:-100}" python3 benchmarks/gpu_suite.py --part $PPART --out /tmp/prof --profile-only ${DRY:+--dry-run} \
  --profile "$ROW" > /tmp/prof.log 2>&1; echo "profile: rc $?"
cp /tmp/prof/profile_*.txt "$OUT"/ 2>/dev/null
if [ "$PART" = serial ]; then  # one RT layer against the batch, eager and graphed, beside spec-003 §3.7's table
  timeout "${LAYER_S:-150}" python3 benchmarks/bench_rt_layer.py ${DRY:+--dry-run} > "$OUT/rt_layer.md" 2>&1
  echo "rt layer: rc $?"
fi
timeout "${TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_ops.py \
  tests/test_gpu_compile.py tests/test_phase_timer.py tests/test_captured.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: rc $?"
# the Triton kernels' tests run on CUDA when Triton's interpreter is off (it is, with a GPU: tests/conftest.py)
timeout "${KERNEL_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_delta_memory_triton.py \
  >> "$OUT/gpu_tests.log" 2>&1; echo "kernel tests: rc $?"
tail -3 "$OUT/gpu_tests.log"; grep -E "^\| |^- " "$OUT/suite_$PART.md" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp --exclude suite/runs --exclude suite/data suite prof.log 2>/dev/null
