#!/usr/bin/env bash
# f_θ trained online on the GPU machine (issue: restoration that holds on data it never saw):
#   1. the training corpus, built there from its own Python installation (tools/ftheta_corpus.py:
#      code, prose, structured text; train/heldout split by source file; data/longeval excluded),
#   2. `kakeya train-ftheta --online` (the verifier in the loop; every SYNTH-th sequence a
#      synthetic long-context task of the train split), resumable: the same command again
#      continues $RUN/save/checkpoint.safetensors,
#   3. `kakeya ftheta-layers` on held-out corpus text: restore only the layers that beat evict-only.
# Env: MODEL (/tmp/models/gemma3-270m), DRAFTER (checkpoints/gemma3-270m/drafter), RUN (/tmp/ftheta-online),
#      INPUT (target_features), RANK (256), STEPS (3000), BATCH (8), MAX_LEN (1024), LR (1e-3), WARMUP (200),
#      SYNTH (8), WINDOW (64: the exact window of the loss's layout), LAYERS (all: the layers in the loss),
#      MLP (0: the width of f_θ's nonlinear branch, --mlp-hidden), INIT (an f_θ directory to start from;
#      empty: random), EXACT (1: --exact-layers), BUDGET (seconds for this call, 540), OUT (/tmp/ftheta-online-out).
# Writes to $OUT when finished: ftheta.tar.partNN = one tar of report.json, loss.png, layers.json,
# train.log, corpus_manifest.json and ftheta/ (bf16), split into 15 MiB parts (the device tool brings
# back files of at most 16 MiB, 8 of them: a rank-1024 f_θ is ~32 MB). Here:
#   cat ftheta.tar.part* | tar -x -C DIR
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
RUN=${RUN:-/tmp/ftheta-online}
INPUT=${INPUT:-target_features}; RANK=${RANK:-256}; STEPS=${STEPS:-3000}; BATCH=${BATCH:-8}
MAX_LEN=${MAX_LEN:-1024}; LR=${LR:-1e-3}; WARMUP=${WARMUP:-200}; SYNTH=${SYNTH:-8}; BUDGET=${BUDGET:-540}
WINDOW=${WINDOW:-64}; LAYERS=${LAYERS:-all}; MLP=${MLP:-0}; INIT=${INIT:-}; EXACT=${EXACT:-0}
EXTRA=()
[ -n "$INIT" ] && EXTRA+=(--init-from "$INIT")
[ "$EXACT" = 1 ] && EXTRA+=(--exact-layers)
OUT=${OUT:-/tmp/ftheta-online-out}
mkdir -p "$OUT" "$RUN"
# Binaries unpacked by `remote.sh prebuilt` (build-cuda/PREBUILT) need no build here.
if [ ! -f build-cuda/PREBUILT ]; then
  if [ ! -f build-cuda/build.ninja ]; then
    TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
    cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
      -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/fto-cmake.log 2>&1 || { tail -30 /tmp/fto-cmake.log; exit 1; }
  fi
  cmake --build build-cuda -j 16 --target kakeya > /tmp/fto-build.log 2>&1 || { tail -50 /tmp/fto-build.log; exit 1; }
fi
echo "[ftheta-online] kakeya built at +$(( $(date +%s) - T0 ))s"
[ -f "$RUN/corpus/train.txt" ] || python3 tools/ftheta_corpus.py --out "$RUN/corpus" --tokenizer "$MODEL/tokenizer.json" 2>&1 | tail -6
echo "[ftheta-online] corpus ready at +$(( $(date +%s) - T0 ))s"
# Leave room for the layer selection (~60 s) and the copies.
build-cuda/kakeya train-ftheta --device cuda --online "$RUN/corpus" --input "$INPUT" --verifier "$MODEL" \
  --drafter "$DRAFTER" --save "$RUN/save" --resume --loss attn_distill_hybrid --rank "$RANK" --steps "$STEPS" \
  --batch "$BATCH" --max-len "$MAX_LEN" --lr "$LR" --lr-schedule cosine --warmup "$WARMUP" --heldout 8 --eval-every 500 \
  --synthetic-every "$SYNTH" --window "$WINDOW" --layers "$LAYERS" --mlp-hidden "$MLP" "${EXTRA[@]}" --deadline $((T0 + BUDGET - 100)) 2>&1 | tr '\r' '\n' | tee -a "$RUN/train.log" \
  | grep -v "^\[train-ftheta\] step" | tail -12
grep "^\[train-ftheta\] step" "$RUN/train.log" | tail -1
if [ ! -f "$RUN/save/f_theta.safetensors" ]; then
  echo "[ftheta-online] not finished: run the same command again to resume"
  exit 0
fi
build-cuda/kakeya ftheta-layers --device cuda --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$RUN/save" \
  --text "$RUN/corpus/heldout.txt" --seqs 8 --seq-len 2048 --save "$RUN/selected" 2>&1 | tr '\r' '\n' | tail -20
PACK=$(mktemp -d)
mkdir -p "$PACK/ftheta"
cp "$RUN/save/report.json" "$RUN/train.log" "$RUN/selected/layers.json" "$PACK/"
cp "$RUN/corpus/manifest.json" "$PACK/corpus_manifest.json"
[ -f "$RUN/save/loss.png" ] && cp "$RUN/save/loss.png" "$PACK/"
cp "$RUN/selected/f_theta_config.json" "$RUN/selected/f_theta.safetensors" "$PACK/ftheta/"
tar -C "$PACK" -cf - . | split -b 15M -d - "$OUT/ftheta.tar.part"
ls -la "$OUT"
echo "[ftheta-online] done at +$(( $(date +%s) - T0 ))s"
