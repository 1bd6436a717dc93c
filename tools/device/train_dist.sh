#!/usr/bin/env bash
# Data-parallel training on the GPU machine (issue: training across GPUs): the scaling table of
# `kakeya launch` against one process, for train-ftheta (online) and train-drafter, in one lease:
#   single      one process, no launcher (the baseline)
#   nccl1       `launch --nproc 1`: the whole c10d path (rendezvous, NCCL all-reduce) on one GPU
#   gloo2       `launch --nproc 2 --backend gloo`: two ranks sharing one GPU (NCCL refuses two ranks on
#               one device), same global batch: sharding, all-reduce and rank-0 checkpoints on CUDA
#   ncclN       with N >= 2 GPUs: N ranks at N x the batch (equal per-GPU batch: the scaling figure)
#   ncclN_same  N ranks at the baseline's global batch (weights must match the baseline's closely)
# tools/dist_compare.py writes OUT/dist-ftheta$TAG.json and OUT/dist-drafter$TAG.json.
# Env: MODEL (/tmp/models/gemma3-270m), DRAFTER (checkpoints/gemma3-270m/drafter), RUN (/tmp/dist-run),
#      STEPS (60), BATCH (8, f_θ sequences of MAX_LEN 1024), DSTEPS (60), DBATCH (16, drafter), OUT
#      (/tmp/dist-out), COMMIT (unknown), EXTRA (more train-ftheta flags, e.g. --no-autocast), TAG
#      (suffix of the run names and JSON files), WHAT ("ftheta drafter").
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
RUN=${RUN:-/tmp/dist-run}
STEPS=${STEPS:-60}; BATCH=${BATCH:-8}; MAX_LEN=${MAX_LEN:-1024}; DSTEPS=${DSTEPS:-60}; DBATCH=${DBATCH:-16}
OUT=${OUT:-/tmp/dist-out}
COMMIT=${COMMIT:-unknown}
EXTRA=${EXTRA:-}; TAG=${TAG:-}; WHAT=${WHAT:-ftheta drafter}
mkdir -p "$OUT" "$RUN"
cmake --build build-cuda -j 16 --target kakeya > /tmp/dist-build.log 2>&1 || { tail -50 /tmp/dist-build.log; exit 1; }
grep -q "KAKEYA_NCCL_INCLUDE:PATH=/" build-cuda/CMakeCache.txt && echo "[dist] NCCL: yes" || echo "[dist] NCCL: no (Gloo only)"
GPUS=$(nvidia-smi -L | wc -l)
K=build-cuda/kakeya

run() {  # name, log, command...
  local name=$1 t=$(date +%s); shift
  "$@" > "$RUN/$name.log" 2>&1 || { tail -20 "$RUN/$name.log"; return 1; }
  echo "[dist] $name: $(( $(date +%s) - t )) s wall"
}
runs_for() {  # batch -> one line per run: name|global batch|launcher prefix
  local b=$1
  echo "single$TAG|$b|"
  echo "nccl1$TAG|$b|launch --nproc 1 --"
  echo "gloo2$TAG|$b|launch --nproc 2 --backend gloo --"
  if [ "$GPUS" -ge 2 ]; then
    echo "nccl$GPUS$TAG|$((b * GPUS))|launch --nproc $GPUS --"
    echo "nccl${GPUS}_same$TAG|$b|launch --nproc $GPUS --"
  fi
}

if [[ " $WHAT " == *" ftheta "* ]]; then
  [ -f "$RUN/corpus/train.txt" ] || python3 tools/ftheta_corpus.py --out "$RUN/corpus" --tokenizer "$MODEL/tokenizer.json" \
    --max-mb 8 2>&1 | tail -1
  NAMES=()
  while IFS='|' read -r name b prefix; do
    rm -rf "$RUN/ftheta-$name"
    run "ftheta-$name" $K $prefix train-ftheta --device cuda --online "$RUN/corpus" --input target_features \
      --verifier "$MODEL" --drafter "$DRAFTER" --loss attn_distill_hybrid --rank 256 --steps "$STEPS" --batch "$b" \
      --max-len "$MAX_LEN" --lr 1e-3 --warmup 20 --heldout 8 --eval-every 0 --synthetic-every 8 \
      --max-train-tokens 2000000 --plot-python '' $EXTRA --save "$RUN/ftheta-$name"
    NAMES+=("ftheta-$name")
  done < <(runs_for "$BATCH")
  python3 tools/dist_compare.py --kind ftheta --run "$RUN" --names "${NAMES[@]}" --commit "$COMMIT" --gpus "$GPUS" \
    --out "$OUT/dist-ftheta$TAG.json" --note "train-ftheta flags added: ${EXTRA:-none}"
fi

if [[ " $WHAT " == *" drafter "* ]]; then
  STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  DARGS=(train-drafter --device cuda --model "$MODEL" --code "$STDLIB" --prose "$SITE" --layers 5 --heads 8
         --kv-heads 1 --head-dim 64 --intermediate 1280 --block-size 16 --prompt-len 64 --gen-len 192
         --train-prompts 512 --eval-prompts 4 --eval-max-new 32 --gen-batch 256 --anchors 24 --lr 1e-3 --warmup 20
         --steps "$DSTEPS" --commit "$COMMIT")
  NAMES=()
  while IFS='|' read -r name b prefix; do
    rm -rf "$RUN/drafter-$name"
    # Every run trains on the first run's continuations (the data stage reuses a complete data/).
    if [ -f "$RUN/drafter-single$TAG/data/manifest.json" ]; then
      mkdir -p "$RUN/drafter-$name" && cp -r "$RUN/drafter-single$TAG/data" "$RUN/drafter-$name/"
    fi
    run "drafter-$name" $K $prefix "${DARGS[@]}" --batch "$b" --out "$RUN/drafter-$name"
    NAMES+=("drafter-$name")
  done < <(runs_for "$DBATCH")
  python3 tools/dist_compare.py --kind drafter --run "$RUN" --names "${NAMES[@]}" --commit "$COMMIT" --gpus "$GPUS" \
    --out "$OUT/dist-drafter$TAG.json"
fi
for f in "$RUN"/*.log; do cp "$f" "$OUT/"; done
echo "[dist] done at +$(( $(date +%s) - T0 ))s"
