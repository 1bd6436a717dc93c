#!/usr/bin/env bash
# Data-parallel f_θ training on the GPU machine (issue: training across GPUs), same online data,
# same global batch, one lease, three ways:
#   single   `kakeya train-ftheta` (no launcher: the one-process baseline)
#   nccl1    `kakeya launch --nproc 1` (NCCL, one rank: the whole c10d path on one GPU)
#   gloo2    `kakeya launch --nproc 2 --backend gloo` (two ranks sharing the GPU: NCCL refuses two
#            ranks on one device) — exercises sharding, the all-reduce and rank-0 checkpoints on CUDA
#   ncclN    `kakeya launch --nproc $GPUS` when the machine has several GPUs (the scaling figure)
# Then tools/dist_compare.py: step throughput of each, and how far each run's final f_θ weights are
# from the single run's (bf16 autocast: equal up to rounding, not bit for bit).
# Env: MODEL (/tmp/models/gemma3-270m), DRAFTER (checkpoints/gemma3-270m/drafter), RUN (/tmp/dist-run),
#      STEPS (60), BATCH (8), MAX_LEN (1024), OUT (/tmp/dist-out), COMMIT (unknown),
#      EXTRA (more train-ftheta flags, e.g. --no-autocast: f32, where the runs must agree closely),
#      TAG (suffix of the run names and of dist$TAG.json).
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
RUN=${RUN:-/tmp/dist-run}
STEPS=${STEPS:-60}; BATCH=${BATCH:-8}; MAX_LEN=${MAX_LEN:-1024}
OUT=${OUT:-/tmp/dist-out}
COMMIT=${COMMIT:-unknown}
EXTRA=${EXTRA:-}; TAG=${TAG:-}
mkdir -p "$OUT" "$RUN"
cmake --build build-cuda -j 16 --target kakeya > /tmp/dist-build.log 2>&1 || { tail -50 /tmp/dist-build.log; exit 1; }
grep -q "KAKEYA_NCCL_INCLUDE:PATH=/" build-cuda/CMakeCache.txt && echo "[dist] NCCL: yes" || echo "[dist] NCCL: no (Gloo only)"
[ -f "$RUN/corpus/train.txt" ] || python3 tools/ftheta_corpus.py --out "$RUN/corpus" --tokenizer "$MODEL/tokenizer.json" \
  --max-mb 8 2>&1 | tail -3
echo "[dist] corpus ready at +$(( $(date +%s) - T0 ))s"
GPUS=$(nvidia-smi -L | wc -l)
ARGS=(train-ftheta --device cuda --online "$RUN/corpus" --input target_features --verifier "$MODEL"
      --drafter "$DRAFTER" --loss attn_distill_hybrid --rank 256 --steps "$STEPS" --batch "$BATCH"
      --max-len "$MAX_LEN" --lr 1e-3 --warmup 20 --heldout 8 --eval-every 0 --synthetic-every 8
      --max-train-tokens 2000000 --plot-python '' $EXTRA)
run() {  # name, launcher args...
  local name=$1$TAG; shift
  rm -rf "$RUN/$name"
  local t=$(date +%s)
  "$@" "${ARGS[@]}" --save "$RUN/$name" > "$RUN/$name.log" 2>&1 || { tail -20 "$RUN/$name.log"; return 1; }
  echo "[dist] $name: $(( $(date +%s) - t )) s wall; $(grep -a '^\[train-ftheta\] step' "$RUN/$name.log" | tr '\r' '\n' | tail -1)"
}
run single build-cuda/kakeya
run nccl1 build-cuda/kakeya launch --nproc 1 --
run gloo2 build-cuda/kakeya launch --nproc 2 --backend gloo --
RUNS="single$TAG nccl1$TAG gloo2$TAG"
if [ "$GPUS" -ge 2 ]; then run "nccl$GPUS" build-cuda/kakeya launch --nproc "$GPUS" --; RUNS="$RUNS nccl$GPUS$TAG"; fi
python3 tools/dist_compare.py --run "$RUN" --names $RUNS --commit "$COMMIT" --gpus "$GPUS" --out "$OUT/dist$TAG.json" \
  --note "train-ftheta flags added: ${EXTRA:-none}"
for n in $RUNS; do cp "$RUN/$n.log" "$OUT/"; done
echo "[dist] done at +$(( $(date +%s) - T0 ))s"
