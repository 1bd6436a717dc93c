#!/usr/bin/env bash
# The restored-verifier decoder on the GPU machine (issue 6): run from the repo root
# through the device tool, one STEP per call (each < 9 minutes; a warm machine keeps
# build-cuda/ between calls):
#   STEP=check  tools/device/restored_eval.sh   # CUDA graph path: a=1 == ar, restored == restored-reforward
#   STEP=bench  tools/device/restored_eval.sh   # kakeya bench decode --restored at 8k, --full-attn exact and codec
#               (CODES="none int8 int4": also each --restored-code; CHUNK: --chunk, 0 = the window)
#   STEP=memory tools/device/restored_eval.sh   # kakeya bench memory --speed at 8k (MEMORY_CONFIGS, BUDGETS, CHUNK, TAG)
#   STEP=niah   tools/device/restored_eval.sh   # NIAH ladder 1k..16k, --full-attn exact and codec
#               (FULL_ATTNS="codec" runs one policy per call when both do not fit in 9 minutes)
#   STEP=sweep  tools/device/restored_eval.sh   # sweep-alpha at 1k
# Env: MODEL (default /tmp/models/gemma3-270m), DRAFTER (default checkpoints/gemma3-270m/drafter),
#      FTHETA (default checkpoints/gemma3-270m/ftheta if it exists, else random:1 = plumbing only),
#      WINDOW (64), SINK (4), FULL_ATTN (exact: check, sweep), FULL_ATTNS ("exact codec": niah, bench),
#      FULL_CODE (lm4: --full-attn codec's rows), CONTEXTS (1024,2048,4096,8192,16384), SAMPLES (1),
#      DEPTHS (0.1,0.3,0.5,0.7,0.9), OUT (default /tmp/restored-out).
# Results in $OUT: check.log, bench_{exact,codec}.json, niah_{exact,codec}.json + .png, sweep.json + sweep.png.
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
if [ -z "${FTHETA:-}" ]; then
  if [ -f checkpoints/gemma3-270m/ftheta/f_theta_config.json ]; then FTHETA=checkpoints/gemma3-270m/ftheta; else FTHETA=random:1; fi
fi
WINDOW=${WINDOW:-64}; SINK=${SINK:-4}; FULL_ATTN=${FULL_ATTN:-exact}; FULL_ATTNS=${FULL_ATTNS:-exact codec}
FULL_CODE=${FULL_CODE:-lm4}
CONTEXTS=${CONTEXTS:-1024,2048,4096,8192,16384}; SAMPLES=${SAMPLES:-1}; DEPTHS=${DEPTHS:-0.1,0.3,0.5,0.7,0.9}
OUT=${OUT:-/tmp/restored-out}
mkdir -p "$OUT"
if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/restored-cmake.log 2>&1 || { tail -30 /tmp/restored-cmake.log; exit 1; }
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/restored-build.log 2>&1 || { tail -50 /tmp/restored-build.log; exit 1; }
K=build-cuda/kakeya
COMMON=(--device cuda --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$FTHETA" --sink "$SINK" --window "$WINDOW"
        --full-code "$FULL_CODE")
echo "[restored] f_theta: $FTHETA"

case ${STEP:-check} in
  check)
    # A prompt past the sliding window (512) so every sliding layer restores; the CUDA graph replays the step.
    python3 -c 'print(open("data/codec/eval.txt").read()[:3000])' > /tmp/restored-prompt.txt
    P="$(cat /tmp/restored-prompt.txt)"
    {
      $K decode "${COMMON[@]}" --mix-alpha 1 --prompt "$P" --max-new-tokens 64 --compare-ar --json "$OUT/check_a1.json"
      $K decode "${COMMON[@]}" --prompt "$P" --max-new-tokens 32 --stats --compare-ar --json "$OUT/check_restored.json"
      $K decode "${COMMON[@]}" --mode restored-reforward --prompt "${P:0:1200}" --max-new-tokens 8 --json "$OUT/check_reforward.json"
      $K decode "${COMMON[@]}" --prompt "${P:0:1200}" --max-new-tokens 8 --json "$OUT/check_incremental.json"
      # Coded restored regions: the same rules, so incremental == reforward with int4 rows too.
      $K decode "${COMMON[@]}" --restored-code int4 --mode restored-reforward --prompt "${P:0:1200}" --max-new-tokens 8 \
        --json "$OUT/check_reforward_int4.json"
      $K decode "${COMMON[@]}" --restored-code int4 --prompt "${P:0:1200}" --max-new-tokens 8 --json "$OUT/check_incremental_int4.json"
      # Coded full-attention layers (--full-attn codec, $FULL_CODE rows) and lm3 restored regions: the same rules.
      $K decode "${COMMON[@]}" --full-attn codec --restored-code lm3 --mode restored-reforward --prompt "${P:0:1200}"         --max-new-tokens 8 --json "$OUT/check_reforward_codec.json"
      $K decode "${COMMON[@]}" --full-attn codec --restored-code lm3 --prompt "${P:0:1200}" --max-new-tokens 8         --json "$OUT/check_incremental_codec.json"
    } > "$OUT/check.log" 2>&1 || { tail -40 "$OUT/check.log"; exit 1; }
    grep -E "^\[decode|identical|differs" "$OUT/check.log"
    python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
a1 = json.load(open(f"{d}/check_a1.json"))["prompts"][0]
print("a=1 restored == ar on CUDA:", a1["ar"]["identical"], "agreeing prefix", a1["ar"]["agreeing_prefix"])
inc = json.load(open(f"{d}/check_incremental.json"))["prompts"][0]["generated_ids"]
ref = json.load(open(f"{d}/check_reforward.json"))["prompts"][0]["generated_ids"]
print("restored == restored-reforward on CUDA:", inc == ref, inc, ref)
inc = json.load(open(f"{d}/check_incremental_int4.json"))["prompts"][0]["generated_ids"]
ref = json.load(open(f"{d}/check_reforward_int4.json"))["prompts"][0]["generated_ids"]
print("restored == restored-reforward on CUDA, int4 restored region:", inc == ref, inc, ref)
inc = json.load(open(f"{d}/check_incremental_codec.json"))["prompts"][0]["generated_ids"]
ref = json.load(open(f"{d}/check_reforward_codec.json"))["prompts"][0]["generated_ids"]
print("restored == restored-reforward on CUDA, coded full-attention layers + lm3 restored region:", inc == ref, inc, ref)
PY
    ;;
  bench)
    for FA in $FULL_ATTNS; do
      for CODE in ${CODES:-none}; do
        echo "[restored] bench decode at 8k, --full-attn $FA --restored-code $CODE"
        $K bench decode --device cuda --model "$MODEL" --prompt-len 8192 --new-tokens 256 --repeats 5 --no-peer \
          --restored --drafter "$DRAFTER" --ftheta "$FTHETA" --sink "$SINK" --window "$WINDOW" --full-attn "$FA" \
          --restored-code "$CODE" --chunk "${CHUNK:-0}" --full-code "$FULL_CODE" --json "$OUT/bench_${FA}_$CODE.json" 2>&1 | tail -14
      done
    done ;;
  niah)
    for FA in $FULL_ATTNS; do
      echo "[restored] NIAH ladder $CONTEXTS, --full-attn $FA"
      $K niah "${COMMON[@]}" --full-attn "$FA" --contexts "$CONTEXTS" --depths "$DEPTHS" --samples "$SAMPLES" \
        --json "$OUT/niah_$FA.json" --plot "$OUT/niah_$FA.png" --python python3 2>&1 | tr '\r' '\n' | grep -v "samples$" | tail -16
    done ;;
  sweep)
    $K sweep-alpha "${COMMON[@]}" --full-attn "$FULL_ATTN" --contexts 1024 --depths "$DEPTHS" --samples "$SAMPLES" \
      --json "$OUT/sweep.json" --plot "$OUT/sweep.png" --python python3 2>&1 | tr '\r' '\n' | grep -v "samples$" | tail -12 ;;
  memory)
    # What a KV budget fits per config (plans), and every config's decode speed at 8k against AR (same run).
    $K bench memory --device cuda --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$FTHETA" --sink "$SINK" \
      --chunk "${CHUNK:-0}" --full-code "$FULL_CODE" --configs "${MEMORY_CONFIGS:-oracle,evict:256,restored:256,restored-int8:256,restored-int4:256,restored-int4:128}" \
      --budget-mb "${BUDGETS:-64,256}" --context 8192 --speed --repeats "${REPEATS:-3}" --json "$OUT/memory${TAG:-}.json" 2>&1 | tail -14 ;;
  *) echo "unknown STEP=$STEP (check | bench | memory | niah | sweep)"; exit 2 ;;
esac
