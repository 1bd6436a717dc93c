#!/usr/bin/env bash
# Train, export and evaluate the Gemma 3 270M DFlash drafter on the GPU machine.
# Run from the repo root through the device tool, the SAME command in two calls
# back to back (a warm machine keeps build-cuda/ and $RUN between calls):
#   call 1: build kakeya (incremental), make the data, train until the call's budget is nearly spent
#   call 2: resume, finish training, export the bf16 drafter, measure τ, copy the results to $OUT
# Every stage resumes where the previous call stopped, so a third call (same
# command) finishes whatever a slow machine left over.
#
# Env: MODEL (default /tmp/models/gemma3-270m), RUN (work dir, default /tmp/drafter-run),
#      BUDGET (seconds this call may use from its start, default 560), COMMIT (recorded in the manifest),
#      TRAIN_SECONDS (optimisation budget over all calls, default 540),
#      LR (peak, default 1e-3), WARMUP (steps, default 200), TRAIN_PROMPTS (per domain, default 12000),
#      SEED (data order, anchors, init; default 0),
#      INIT (a drafter dir: fine-tune it with --init DIR --freeze-context, so an f_θ trained on
#      it stays valid; use a fresh RUN, since a RUN's data and checkpoint are reused).
# Needs: the model converted by tools/device/remote.sh (model step), .carry/include if the
# image lacks nlohmann/CLI11 headers (tools/device/prepare.sh).
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
RUN=${RUN:-/tmp/drafter-run}
BUDGET=${BUDGET:-560}
COMMIT=${COMMIT:-unknown}
TRAIN_SECONDS=${TRAIN_SECONDS:-540}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-200}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-12000}
SEED=${SEED:-0}
INIT_ARGS=()
if [ -n "${INIT:-}" ]; then INIT_ARGS=(--init "$INIT" --freeze-context); fi

if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/drafter-cmake.log
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/drafter-build.log 2>&1 || { tail -50 /tmp/drafter-build.log; exit 1; }
echo "[drafter] kakeya built at +$(( $(date +%s) - T0 ))s"

# Sources that every machine with Python carries: its standard library (code) and the
# installed packages' descriptions/licenses plus system license texts (prose).
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
PROSE=("$SITE")
for d in /usr/share/common-licenses /usr/share/doc; do [ -d "$d" ] && PROSE+=("$d"); done

build-cuda/kakeya train-drafter --device cuda --model "$MODEL" --out "$RUN" \
  --code "$STDLIB" --prose "${PROSE[@]}" \
  --layers 5 --heads 8 --kv-heads 1 --head-dim 64 --intermediate 1280 --block-size 16 \
  --prompt-len 64 --gen-len 192 --train-prompts "$TRAIN_PROMPTS" --eval-prompts 48 --eval-max-new 192 --gen-batch 256 \
  --batch 16 --anchors 24 --gamma 7 --lr "$LR" --warmup "$WARMUP" --train-seconds "$TRAIN_SECONDS" --seed "$SEED" \
  ${INIT_ARGS[@]+"${INIT_ARGS[@]}"} --deadline $((T0 + BUDGET)) --commit "$COMMIT"

if [ -f "$RUN/drafter/manifest.json" ]; then  # written once the held-out evaluation is done
  python3 tools/plot_drafter_loss.py "$RUN/report.json" "$RUN/loss.png"
  sha256sum "$RUN/drafter/model.safetensors"
  if [ -n "${OUT:-}" ]; then
    # The device tool returns files of at most 16 MiB: the weights travel in 15 MiB parts.
    mkdir -p "$OUT/drafter"
    cp "$RUN/drafter/config.json" "$RUN/drafter/manifest.json" "$OUT/drafter/"
    split -b 15M -d "$RUN/drafter/model.safetensors" "$OUT/drafter/model.safetensors.part"
    cp "$RUN/report.json" "$RUN/loss.png" "$OUT/"
    ls -la "$OUT" "$OUT/drafter"
  fi
  python3 - "$RUN/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for d in ("code", "prose"):
    e = r["eval"][d]
    print(f"[drafter] {d}: tau {e['tau']:.3f} (per-prompt {e['tau_mean_per_prompt']:.3f}) over {e['prompts']} held-out prompts, "
          f"lossless {e['lossless_prompts']}/{e['prompts']}, spec {e['spec_tokens_per_second']:.0f} vs AR {e['ar_tokens_per_second']:.0f} tok/s")
t = r["train"]
print(f"[drafter] trained {t['steps']} steps in {t['seconds']:.0f}s ({t['ms_per_step']:.0f} ms/step), {t['parameters']/1e6:.1f}M params")
PY
else
  echo "[drafter] not finished yet: run the same command again (it resumes)"
fi
echo "[drafter] call used $(( $(date +%s) - T0 ))s"
