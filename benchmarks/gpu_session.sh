#!/usr/bin/env bash
# One device call's worth of GPU work, prepared (GPU time comes in ~15-minute windows, each machine start
# costing 1-2 of them): the suite's part $1 (default transformer), a torch.profiler capture of
# baseline/s without masks, and the gpu-marked tests. About 9 minutes; each stage has its own timeout,
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
timeout "${PROFILE_S:-100}" python3 benchmarks/gpu_suite.py --part transformer --out /tmp/prof --profile-only ${DRY:+--dry-run} \
  --profile "baseline/s no-mask" > /tmp/prof.log 2>&1; echo "profile: rc $?"
cp /tmp/prof/profile_*.txt "$OUT"/ 2>/dev/null
timeout "${TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_ops.py \
  tests/test_gpu_compile.py tests/test_phase_timer.py > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: rc $?"
tail -3 "$OUT/gpu_tests.log"; grep -E "^\| |^- " "$OUT/suite_$PART.md" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp --exclude suite/runs --exclude suite/data suite prof.log 2>/dev/null
