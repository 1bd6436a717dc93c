#!/usr/bin/env bash
# f_θ at full scale on the GPU machine: capture (if not there yet), then
# `kakeya train-ftheta` with attn_distill_hybrid, resumable across calls.
# Run from the repo root through the device tool, the SAME command repeated
# (a warm machine keeps build-cuda/ and $RUN between calls; each call stops
# before its budget and the next one resumes):
#   tools/device/train_ftheta.sh
# Env: MODEL (default /tmp/models/gemma3-270m), DRAFTER (default checkpoints/gemma3-270m/drafter),
#      RUN (work dir, default /tmp/ftheta-run), BUDGET (seconds this call may use, default 540),
#      SEQS (corpus prompts, default 48), NIAH (NIAH prompts, default 48), GEN_LEN (default 256),
#      STEPS (default 4000), RANK (default 256), MAX_LEN (default 1024), BATCH (default 4).
# Writes to $OUT when training is finished: report.json, loss.png, train.log, and
# ftheta/{f_theta_config.json, f_theta.safetensors} (f32, in 15 MiB parts).
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
RUN=${RUN:-/tmp/ftheta-run}
BUDGET=${BUDGET:-540}
SEQS=${SEQS:-48}; NIAH=${NIAH:-48}; GEN_LEN=${GEN_LEN:-256}
STEPS=${STEPS:-4000}; RANK=${RANK:-256}; MAX_LEN=${MAX_LEN:-1024}; BATCH=${BATCH:-4}
OUT=${OUT:-/tmp/ftheta-out}
mkdir -p "$OUT" "$RUN"

if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/ftheta-cmake.log 2>&1 || { tail -30 /tmp/ftheta-cmake.log; exit 1; }
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/ftheta-build.log 2>&1 || { tail -50 /tmp/ftheta-build.log; exit 1; }
echo "[ftheta] kakeya built at +$(( $(date +%s) - T0 ))s"

# 1. Capture (resumable; the verifier's dtype is bf16 on CUDA, stored losslessly).
python3 - "$SEQS" > "$RUN/prompts.txt" <<'PY'
import sys
paras = [p.strip() for p in open("data/codec/eval.txt").read().split("\n\n") if len(p.strip()) > 200]
print("\n\n".join(paras[: int(sys.argv[1])]))
PY
build-cuda/kakeya capture --device cuda --verifier "$MODEL" --drafter "$DRAFTER" \
  --prompts "$RUN/prompts.txt" --niah "$NIAH" --niah-min-tokens 384 --niah-max-tokens 768 \
  --gen-len "$GEN_LEN" --out "$RUN/capture" --seqs-per-shard 8 --bench-seqs 0 2>&1 | tr '\r' '\n' | tail -3
echo "[ftheta] capture done at +$(( $(date +%s) - T0 ))s"

# 2. Train (resumes $RUN/save/checkpoint.safetensors), stopping before this call's budget.
build-cuda/kakeya train-ftheta --device cuda --data "$RUN/capture" --verifier "$MODEL" --drafter "$DRAFTER" \
  --save "$RUN/save" --resume --loss attn_distill_hybrid --rank "$RANK" --steps "$STEPS" --batch "$BATCH" \
  --max-len "$MAX_LEN" --lr 1e-3 --lr-schedule cosine --warmup 200 --heldout 8 --eval-every 500 \
  --deadline $((T0 + BUDGET)) 2>&1 | tee -a "$RUN/train.log" | grep -v "^\[train-ftheta\] step" | tail -12

if [ -f "$RUN/save/f_theta.safetensors" ]; then
  mkdir -p "$OUT/ftheta"
  cp "$RUN/save/report.json" "$RUN/train.log" "$OUT/"
  [ -f "$RUN/save/loss.png" ] && cp "$RUN/save/loss.png" "$OUT/"
  cp "$RUN/save/f_theta_config.json" "$OUT/ftheta/"
  split -b 15M -d "$RUN/save/f_theta.safetensors" "$OUT/ftheta/f_theta.safetensors.part"
  python3 - "$RUN/save/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("held-out loss %.4g -> %.4g: reduction %.2fx in %d steps, %.0fs" % (r["heldout_loss_initial"],
      r["heldout_loss_final"], r["reduction_factor"], r["steps_done"], r["train_seconds"]))
for t, s in r["final"]["by_layer_type"].items():
    print(f"{t}: K rel MSE {s['k_rel_mse']:.4f}  V rel MSE {s['v_rel_mse']:.4f}  kDir {s['k_dir']:.4f}  "
          f"vDir {s['v_dir']:.4f}  attn ratio {s['attn_ratio']:.4f}")
PY
else
  echo "[ftheta] not finished: run the same command again to resume"
fi
