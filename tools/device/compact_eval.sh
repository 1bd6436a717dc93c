#!/usr/bin/env bash
# The compact restored decoder's measurements on the GPU machine (issue 21), one STEP per call, from
# the synced tree (/tmp/ksrc: tools/device/sync_src.sh) with build-cuda/ built and the model under
# /tmp/models (tools/device/remote.sh). Results in $OUT (the device tool brings them back).
#   STEP=tests   the GPU tests of the kernels and the restored decoder (ctest -R, or the test binaries
#                themselves when build-cuda/ holds prebuilt ones; output in tests-TAG.txt)
#   STEP=memory  kakeya bench memory --speed at 8k and 32k (window 64, chunk 64): K/V bytes against the
#                native cache, decode and prefill speed against AR, per config (MEMORY_CONFIGS)
#   STEP=ppl     kakeya eval-long perplexity at CONTEXTS, PPL_DOCS held-out documents, the compact modes
#                paired with the uncompressed restored decoder (PPL_CONFIGS, REFERENCE)
#   STEP=tasks   kakeya eval-long's task suite at TASK_CONTEXTS (TASK_CONFIGS, SAMPLES, BUDGET seconds)
#   STEP=decode  kakeya bench decode (AR at 512 and 8k prompts; the decode speed issue's numbers)
# Env: MODEL (/tmp/models/gemma3-270m), OUT ($OUT or /tmp/compact-out), TAG (file name suffix, "h200"),
#      KAKEYA_COMMIT (the commit the JSONs name: the device copy has no .git, so set it in the call).
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
OUT=${OUT:-/tmp/compact-out}
TAG=${TAG:-h200}
K=build-cuda/kakeya
mkdir -p "$OUT"
MEMORY_CONFIGS=${MEMORY_CONFIGS:-oracle,restored:64,restored-int4:64,restored-int8:64,restored-ru5:64,restored-ru5-codec-pw4:64,restored-ru5-codec-pw5v3:64}
PPL_CONFIGS=${PPL_CONFIGS:-oracle,evict:64,restored:64,restored-int4:64,restored-int8:64,restored-ru5:64,restored-ru5-codec-pw4:64,restored-ru5-codec-pw5v3:64}
TASK_CONFIGS=${TASK_CONFIGS:-restored:64,restored-ru5:64,restored-ru5-codec-pw5v3:64}
REFERENCE=${REFERENCE:-restored:64}
CONTEXTS=${CONTEXTS:-8192,16384}
TASK_CONTEXTS=${TASK_CONTEXTS:-8192}
PPL_DOCS=${PPL_DOCS:-9}
SAMPLES=${SAMPLES:-3}
BUDGET=${BUDGET:-500}
case ${STEP:?STEP=tests|memory|ppl|tasks|decode} in
  tests)
    if [ -f build-cuda/CTestTestfile.cmake ]; then
      (cd build-cuda && KAKEYA_MODEL_DIR=$MODEL ctest -R "${TESTS:-test_cuda_ops|test_cuda_restored}" --output-on-failure) \
        > "$OUT/tests-$TAG.txt" 2>&1 && ok=0 || ok=$?
    else  # prebuilt binaries (tools/device/prebuild.sh) come without CTest's files: run the suites themselves
      ok=0
      for t in $(echo "${TESTS:-test_cuda_ops|test_cuda_restored}" | tr '|' ' '); do
        KAKEYA_MODEL_DIR=$MODEL KAKEYA_SOURCE_DIR=$PWD build-cuda/tests/$t || ok=$?
      done > "$OUT/tests-$TAG.txt" 2>&1
    fi
    grep -E "tests passed|tests failed|Failed|\*\*\*|FAILED|PASSED|tests ran" "$OUT/tests-$TAG.txt" | tail -20
    exit $ok ;;
  memory)
    for ctx in ${MEMORY_CONTEXTS:-8192 32768}; do
      $K bench memory --verifier "$MODEL" --device cuda --speed --context "$ctx" --window 64 --chunk 64 \
        --configs "$MEMORY_CONFIGS" --json "$OUT/bench-memory-$((ctx / 1024))k-$TAG.json" 2>&1 | grep -v "ETA"
    done ;;
  ppl)
    $K eval-long --device cuda --verifier "$MODEL" --window 64 --chunk 64 --tasks none --contexts "$CONTEXTS" \
      --ppl-docs "$PPL_DOCS" --configs "$PPL_CONFIGS" --reference "$REFERENCE" --budget "$BUDGET" \
      --json "$OUT/eval-long-ppl-$TAG.json" --plot "$OUT/eval-long-ppl-$TAG.png" --python python3 2>&1 \
      | tr '\r' '\n' | grep -v "ETA" | tail -40 ;;
  tasks)
    $K eval-long --device cuda --verifier "$MODEL" --window 64 --chunk 64 --tasks all --contexts "$TASK_CONTEXTS" \
      --samples "$SAMPLES" --ppl-docs 0 --configs "$TASK_CONFIGS" --reference "$REFERENCE" --budget "$BUDGET" \
      --json "$OUT/eval-long-tasks-$TAG.json" --plot "$OUT/eval-long-tasks-$TAG.png" --python python3 2>&1 \
      | tr '\r' '\n' | grep -v "ETA" | tail -40 ;;
  decode)
    for p in 512 8192; do
      $K bench decode --model "$MODEL" --device cuda --prompt-len $p --new-tokens 256 --repeats 3 --no-peer \
        --json "$OUT/bench-decode-$p-$TAG.json" 2>&1 | tail -12
    done ;;
  *) echo "compact_eval.sh: STEP: expected tests | memory | ppl | tasks | decode, got '$STEP'"; exit 2 ;;
esac
