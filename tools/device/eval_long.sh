#!/usr/bin/env bash
# The long-context suite on the GPU machine (`kakeya eval-long --device cuda`): oracle vs
# evict-only vs restored decoders on data/longeval.h's tasks and held-out perplexity. Run from
# the repo root through the device tool (the model under /tmp/models: tools/device/remote.sh);
# a warm machine keeps build-cuda/ between calls. Stops itself before BUDGET seconds from its
# start: the build's time is taken from the run's, and eval-long ends before a prompt that would
# pass its --budget, writing what is done with "partial": true.
# Env: MODEL (/tmp/models/gemma3-270m), DRAFTER (checkpoints/gemma3-270m/drafter),
#      FTHETA (checkpoints/gemma3-270m/ftheta),
#      CONFIGS (oracle,evict:256,restored:256: the default window), TASKS (all), CONTEXTS (1024,2048,4096,8192,16384),
#      SAMPLES (3), PPL_DOCS (4), SINK (4), RESTORE_LAYERS (auto), EXTRA (more eval-long flags),
#      BUDGET (540 s), OUT (/tmp/eval-long-out),
#      REPORT ($OUT/eval_long.json; a path outside $OUT, e.g. /tmp/eval-long/report.json, outlives the
#      call on a warm machine), RESUME (0; 1: continue REPORT: its prompts and documents are not run
#      again, so several calls with the same settings add up to one run; more SAMPLES adds samples).
# Results in $OUT: eval_long.json, eval_long.png, eval_long-ppl.png, eval_long.log.
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
FTHETA=${FTHETA:-checkpoints/gemma3-270m/ftheta}
CONFIGS=${CONFIGS:-oracle,evict:256,restored:256}
TASKS=${TASKS:-all}
CONTEXTS=${CONTEXTS:-1024,2048,4096,8192,16384}
SAMPLES=${SAMPLES:-3}
PPL_DOCS=${PPL_DOCS:-4}
SINK=${SINK:-4}
RESTORE_LAYERS=${RESTORE_LAYERS:-auto}
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/eval-long-out}
REPORT=${REPORT:-$OUT/eval_long.json}
RESUME_FLAG=""; [ "${RESUME:-0}" = 1 ] && RESUME_FLAG="--resume"
mkdir -p "$OUT" "$(dirname "$REPORT")"
if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/eval-long-cmake.log 2>&1 || { tail -30 /tmp/eval-long-cmake.log; exit 1; }
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/eval-long-build.log 2>&1 || { tail -50 /tmp/eval-long-build.log; exit 1; }
# What is left of BUDGET after the build, less a margin for loading, the last prompt's overrun,
# the JSON and the plots; the hard stop (timeout) only guards against a run that ignores it.
LEFT=$((BUDGET - SECONDS - 30))
[ "$LEFT" -gt 30 ] || { echo "[eval-long] the build left ${LEFT}s of BUDGET=${BUDGET}s: rerun on the warm machine"; exit 1; }
echo "[eval-long] configs $CONFIGS, contexts $CONTEXTS, $SAMPLES sample(s), f_theta $FTHETA, budget ${LEFT}s"
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout --signal=KILL $((LEFT + 25)) build-cuda/kakeya eval-long --device cuda --verifier "$MODEL" --drafter "$DRAFTER" \
  --ftheta "$FTHETA" --sink "$SINK" --restore-layers "$RESTORE_LAYERS" --configs "$CONFIGS" \
  --tasks "$TASKS" --contexts "$CONTEXTS" --samples "$SAMPLES" --ppl-docs "$PPL_DOCS" --budget "$LEFT" ${EXTRA:-} \
  $RESUME_FLAG --json "$REPORT" --plot "$OUT/eval_long.png" --python python3 > "$OUT/eval_long.log" 2>&1 || {
  rc=$?; tr '\r' '\n' < "$OUT/eval_long.log" | tail -30; echo "[eval-long] exit $rc"; exit $rc; }
# The progress line rewrites itself with \r: keep its last state, then the tables.
tr '\r' '\n' < "$OUT/eval_long.log" | grep -v "^\[eval-long\] .*ETA" | tail -80
tr '\r' '\n' < "$OUT/eval_long.log" | grep "^\[eval-long\] .*ETA" | tail -1
[ "$REPORT" -ef "$OUT/eval_long.json" ] || cp "$REPORT" "$OUT/eval_long.json"
