#!/usr/bin/env bash
# One device call's worth of GPU work, prepared (GPU time comes in ~15-minute windows, each machine start
# costing 1-2 of them). Stages (STAGES, comma-separated; default all that apply to the part):
#   suite    the suite's part $1 (default transformer; serial: 3 timed steps a row, cap 100 s)
#   profile  a torch.profiler capture of baseline/s without masks (serial: RT with graphs; PROFILE_ROW)
#   layer    serial only: bench_rt_layer.py, one RT layer against the batch beside spec-003 §3.7's table
#   tests    the gpu-marked tests, the Triton kernels' tests on CUDA, the attention paths' (not flex)
# The transformer part takes about 11 minutes; the serial part's suite alone about 9, so run it as two calls:
# STAGES=suite, then STAGES=layer,tests,profile. ONLY picks rows of the part (a row's exact name, or a part of
# names; ';' between them) to split a part over calls, keeping each ratio's rows in one call (ratios are of one
# call's rows): ONLY="baseline/s no-mask;baseline/s;baseline/s sdpa;sps/s" SUITE_S=540 (HF, SDPA and SPS ratios),
# then ONLY="baseline/m;cart;crt" SUITE_S=480, and for the blocks rows ONLY="baseline/s no-mask;baseline/s;blocks"
# (HF again). WARM_JOBS=N first trains every picked row for one step, N at once, so that the timed runs load
# their compiled graphs from the caches that fills (benchmarks/suite_warm.py). Each stage has its own timeout, so one slow stage cannot take the rest. Results go to $OUT (default ./gpu_out): suite.log, suite_<part>.md/.json, profile_*.txt,
# rt_layer.md, gpu_tests.log, logs.tgz (every run's log).
#     bash benchmarks/gpu_session.sh transformer      # run the suite before and after a change
#     DRY=1 bash benchmarks/gpu_session.sh all        # rehearse it on a CPU (tiny shapes; the gpu tests skip)
set -u; cd "$(dirname "$0")/.."; OUT=${OUT:-gpu_out}; PART=${1:-transformer}; mkdir -p "$OUT"
STAGES=",${STAGES:-suite,profile,layer,tests},"; has() { [[ "$STAGES" == *",$1,"* ]]; }
# the device image lacks omegaconf and antlr4 (and megatron-core, for its gpu tests): carried as wheels, each
# installed alone so that one the image's Python cannot take (megatron-core's is built per Python) skips only itself
for w in .whl/*.whl; do [ -e "$w" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
    >/dev/null 2>&1 || echo "wheel not installed (this Python cannot take it): $w"
done
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
if [ "$PART" = serial ]; then ROW=${PROFILE_ROW:-rt/300m-12l graphs}; PPART=serial; STEPS=${STEPS:-3}; CAP=${CAP_S:-100}; PSTEPS=1
else ROW=${PROFILE_ROW:-baseline/s no-mask}; PPART=transformer; STEPS=${STEPS:-8}; CAP=${CAP_S:-80}; PSTEPS=2; fi
if has suite; then
  ONLY_ARGS=(); IFS=';' read -ra PICK <<< "${ONLY:-}"; for o in ${PICK[@]+"${PICK[@]}"}; do ONLY_ARGS+=(--only "$o"); done
  # the suite rewrites its table after every row; a copier puts it in $OUT every few seconds, so a call stopped
  # by the device tool's own limit (the session's time running out) still brings back the rows it finished
  (while sleep 5; do cp /tmp/suite/suite_"$PART".* "$OUT"/ 2>/dev/null; done) & COPIER=$!
  timeout "${SUITE_S:-$([ "$PART" = serial ] && echo 560 || echo 330)}" python3 benchmarks/gpu_suite.py --part "$PART" \
    --out /tmp/suite --cap "$CAP" --steps "$STEPS" ${DRY:+--dry-run} --commit "${COMMIT:-}" ${ONLY_ARGS[@]+"${ONLY_ARGS[@]}"} \
    --warm-jobs "${WARM_JOBS:-0}" \
    > "$OUT/suite.log" 2>&1
  RC=$?; kill "$COPIER" 2>/dev/null; wait "$COPIER" 2>/dev/null
  echo "suite: rc $RC"; cp /tmp/suite/suite_"$PART".* "$OUT"/ 2>/dev/null
fi
if has profile; then
  timeout "${PROFILE_S:-100}" python3 benchmarks/gpu_suite.py --part $PPART --out /tmp/prof --profile-only ${DRY:+--dry-run} \
    --profile "$ROW" --profile-steps "$PSTEPS" > /tmp/prof.log 2>&1; echo "profile: rc $?"; cp /tmp/prof/profile_*.txt "$OUT"/ 2>/dev/null
fi
if has layer && [ "$PART" = serial ]; then
  # the batches of spec-003 §3.7's table that matter (two at 512 or more refit the planner: measured first, so
  # that a timeout leaves the refit; the table sorts them), with the pieces compiled as training runs them (not
  # in a dry run: its emulated graphs cannot run compiled code)
  # then (LAYER_PROFILE=B, default 512) one layer's kernels by device time at batch B, captured and eager;
  # LAYER_NO_EAGER=1 times the graphs alone (what the refit reads: the eager rows cost about a minute, by estimate)
  if [ -n "${DRY:-}" ]; then LAYER_ARGS="--dry-run --profile 2"
  else LAYER_ARGS="--compile --batches ${LAYER_BATCHES:-512,2048,32,128} --profile ${LAYER_PROFILE:-512}"; fi
  [ -n "${LAYER_NO_EAGER:-}" ] && LAYER_ARGS="$LAYER_ARGS --no-eager"
  timeout "${LAYER_S:-200}" python3 benchmarks/bench_rt_layer.py $LAYER_ARGS > "$OUT/rt_layer.md" 2>&1
  echo "rt layer: rc $?"; grep -E "^\| |constants|^- (forward|backward) " "$OUT/rt_layer.md" | cut -c1-400
fi
if has tests; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_ops.py \
    tests/test_gpu_compile.py tests/test_phase_timer.py tests/test_captured.py tests/test_gpu_engines.py \
    tests/test_hf_remote.py tests/test_memory_trace.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: rc $?"
  # the Triton kernels' tests run on CUDA when Triton's interpreter is off (it is, with a GPU: tests/conftest.py)
  timeout "${KERNEL_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_delta_memory_triton.py \
    >> "$OUT/gpu_tests.log" 2>&1; echo "kernel tests: rc $?"
  # the attention paths and the RT tile on the device (FlexAttention's own tests' compiles would not fit the
  # stage's time), and the measured choice on CUDA, eager and made at trace time under torch.compile (its
  # candidates include FlexAttention: the nested compile that broke a compiled masked run on the CPU)
  timeout "${ATTN_TESTS_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_attention.py \
    tests/test_kernel_measure.py -k "not flex" >> "$OUT/gpu_tests.log" 2>&1; echo "attention tests: rc $?"
  tail -3 "$OUT/gpu_tests.log"
fi
grep -E "^\| |^- " "$OUT/suite_$PART.md" 2>/dev/null
LOGS=(); for f in suite prof.log; do [ -e "/tmp/$f" ] && LOGS+=("$f"); done  # a missing one made tar's rc 2
[ ${#LOGS[@]} -gt 0 ] && tar czf "$OUT/logs.tgz" -C /tmp --exclude suite/runs --exclude suite/data "${LOGS[@]}"
true
