#!/usr/bin/env bash
# Fused speculative decoding on the restored verifier (issue 7) on the GPU machine:
# run from the repo root through the device tool, one STEP per call (each < 9 minutes;
# a warm machine keeps build-cuda/ and /tmp/models between calls). The model must be in
# /tmp/models/gemma3-270m first (tools/device/remote.sh recv … model, see its header).
#   STEP=bench    tools/device/spec_bench.sh  # kakeya bench spec: ar | restored | fused tok/s, τ, per-block
#                                             # split, held-out code + prose, NIAH 4k + 16k (bf16)
#   STEP=check    tools/device/spec_bench.sh  # lossless in f32 on CUDA (graphs on): fused == ar at a = 1,
#                                             # fused == restored at a = 0
#   STEP=profile  tools/device/spec_bench.sh  # ncu: per-kernel time of short eager ar and fused decodes
#   STEP=all      tools/device/spec_bench.sh  # check + bench (both fit in one call when the build is done)
# Env: MODEL (/tmp/models/gemma3-270m), DRAFTER (checkpoints/gemma3-270m/drafter),
#      FTHETA (checkpoints/gemma3-270m/ftheta if it exists, else random:1),
#      ALPHA (0 with a trained f_θ; 1 = exact restoration with a random one, so τ and the tokens are real),
#      WINDOW (64), SINK (4), BLOCK (0 = the drafter's 16), PROMPTS (8 per domain), NEW (192),
#      NIAH ("4096,16384"), NIAH_NEW (24), CODE/PROSE (train-drafter's held-out roots), OUT (/tmp/spec-out).
# Results in $OUT: spec.json (+ spec.log), check.log, profile.txt (+ profile_{ar,fused}.csv).
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
if [ -z "${FTHETA:-}" ]; then
  if [ -f checkpoints/gemma3-270m/ftheta/f_theta_config.json ]; then FTHETA=checkpoints/gemma3-270m/ftheta; else FTHETA=random:1; fi
fi
if [ -z "${ALPHA:-}" ]; then
  case $FTHETA in random*) ALPHA=1 ;; *) ALPHA=0 ;; esac
fi
WINDOW=${WINDOW:-64}; SINK=${SINK:-4}; BLOCK=${BLOCK:-0}; PROMPTS=${PROMPTS:-8}; NEW=${NEW:-192}
NIAH=${NIAH:-4096,16384}; NIAH_NEW=${NIAH_NEW:-24}
CODE=${CODE:-/usr/lib/python3.12}
PROSE=${PROSE:-"/opt/torch/.venv/lib/python3.12/site-packages /usr/share/common-licenses /usr/share/doc"}
OUT=${OUT:-/tmp/spec-out}
mkdir -p "$OUT"
if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/spec-cmake.log 2>&1 || { tail -30 /tmp/spec-cmake.log; exit 1; }
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/spec-build.log 2>&1 || { tail -50 /tmp/spec-build.log; exit 1; }
K=build-cuda/kakeya
[ -d "$MODEL" ] || { echo "no model at $MODEL: run tools/device/remote.sh recv (per chunk) and model first"; exit 1; }
echo "[spec] f_theta $FTHETA, a=$ALPHA, sink $SINK, window $WINDOW, block $BLOCK"
# shellcheck disable=SC2206
PROSE_ARR=($PROSE)

check() {
  # Code prompts past the window; f32 so that a B-token and a 1-token forward round alike.
  {
    $K bench spec --device cuda --dtype f32 --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$FTHETA" \
      --sink "$SINK" --window "$WINDOW" --block-size "$BLOCK" --mix-alpha 1 --modes ar,fused --prompts 4 \
      --new-tokens 128 --niah-contexts "" --code "$CODE" --prose "${PROSE_ARR[@]}" --json "$OUT/check_a1.json"
    $K bench spec --device cuda --dtype f32 --verifier "$MODEL" --drafter "$DRAFTER" --ftheta random:1 \
      --sink "$SINK" --window "$WINDOW" --block-size "$BLOCK" --mix-alpha 0 --modes restored,fused --prompts 3 \
      --new-tokens 64 --niah-contexts 1024 --code "$CODE" --prose "${PROSE_ARR[@]}" --json "$OUT/check_a0.json"
  } > "$OUT/check.log" 2>&1 || { tail -40 "$OUT/check.log"; exit 1; }
  grep -v "prompts$" "$OUT/check.log" | tr '\r' '\n' | grep -E "^(set|code|prose|niah|draft|\[bench)" || true
  python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
for f, key in (("check_a1.json", "identical_to_ar"), ("check_a0.json", "identical_to_restored")):
    j = json.load(open(f"{d}/{f}"))
    for s in j["sets"]:
        m = s["modes"]["fused"]
        print(f"{f}: {s['set']}: fused {key} {m[key]}/{s['prompts']}, tau {m['tau']:.2f}")
PY
}

bench() {
  set -o pipefail
  $K bench spec --device cuda --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$FTHETA" --sink "$SINK" \
    --window "$WINDOW" --block-size "$BLOCK" --mix-alpha "$ALPHA" --prompts "$PROMPTS" --new-tokens "$NEW" \
    --niah-contexts "$NIAH" --niah-new "$NIAH_NEW" --code "$CODE" --prose "${PROSE_ARR[@]}" \
    --json "$OUT/spec.json" 2>&1 | tr '\r' '\n' | grep -v "prompts$" | tee "$OUT/spec.log"
  python3 - "$OUT/spec.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for s in j["sets"]:
    f = s["modes"].get("fused")
    if not f:
        continue
    sh = f["split"]["share_of_decode"]
    print(f"{s['set']}: fused/ar {s.get('fused_vs_ar', 0):.2f}x, fused/restored {s.get('fused_vs_restored', 0):.2f}x, "
          f"tau {f['tau']:.2f}; fused decode time: draft {100*sh['draft']:.0f}%, verify {100*sh['verify']:.0f}%, "
          f"upkeep {100*sh['upkeep']:.0f}%, graph capture {100*sh['graph_capture']:.0f}%, "
          f"host+gaps (incl. the eager first block) {100*sh['host_and_gaps']:.0f}%")
PY
}

profile() {
  # Where a block's time goes, per kernel: ncu times every kernel of short eager runs (no CUDA
  # graphs, duration only, so each kernel is replayed once): ar alone, then fused alone, one
  # held-out code prompt each. Kernel names are grouped; totals and calls per run.
  for M in ar fused; do
    ncu --metrics gpu__time_duration.sum --csv --print-units base \
      $K bench spec --device cuda --verifier "$MODEL" --drafter "$DRAFTER" --ftheta "$FTHETA" --sink "$SINK" \
      --window "$WINDOW" --block-size "$BLOCK" --mix-alpha "$ALPHA" --prompts 1 --new-tokens 64 --niah-contexts "" \
      --code "$CODE" --prose "${PROSE_ARR[@]}" --modes $M --warmup 0 --no-graph \
      > "$OUT/profile_$M.csv" 2> "$OUT/profile_$M.err" || { tail -20 "$OUT/profile_$M.err"; exit 1; }
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/profile.txt"
import csv, sys, collections
d = sys.argv[1]
for m in ("ar", "fused"):
    rows = [r for r in csv.reader(open(f"{d}/profile_{m}.csv")) if len(r) > 5]
    hdr = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Value" in r), None)
    if hdr is None:
        print(f"{m}: no kernel rows in the ncu output"); continue
    h = rows[hdr]
    ki, vi = h.index("Kernel Name"), h.index("Metric Value")
    tot = collections.Counter(); cnt = collections.Counter()
    for r in rows[hdr + 1:]:
        name = r[ki].split("(")[0].split("<")[0][:70]
        tot[name] += float(r[vi].replace(",", "")) / 1e3; cnt[name] += 1
    all_us = sum(tot.values())
    print(f"== {m}: {sum(cnt.values())} kernels, {all_us/1e3:.2f} ms of kernel time (one code and one prose prompt, 64 tokens each, prefill included)")
    for k, v in tot.most_common(22):
        print(f"{100*v/all_us:5.1f}%  {v/cnt[k]:7.2f} us x {cnt[k]:5d}  {k}")
PY
}

case ${STEP:-bench} in
  check) check ;;
  bench) bench ;;
  profile) profile ;;
  all) check; bench ;;
  *) echo "unknown STEP=$STEP (check | bench | profile | all)"; exit 2 ;;
esac
