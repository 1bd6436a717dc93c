#!/usr/bin/env bash
# Issue 5 on the GPU machine: calibrate the KV codec bundle for Gemma 3 270M on 64k
# tokens (timed: the issue's "≤ 2 min on H100"), then Scenario A codec-eval of our
# recipes against every baseline. One call, from the repo root, kakeya already built
# at build-cuda/kakeya (tools/device/remote.sh build). Budget: well under 9 minutes
# (CPU timings scaled: calibration ~1 min, both evaluations ~2 min).
#
# Env: MODEL (default /tmp/models/gemma3-270m), OUT (results; default /tmp/codec-out),
#      RUN (work dir, default /tmp/codec-run), COMMIT (recorded in the manifest; default: git HEAD).
# Results in $OUT (at most 8 files):
#   table.txt           both codec-eval tables + the calibration benchmark lines
#   codec_eval.json     main evaluation (context 1536, 224 eval tokens, 16 passages)
#   codec_eval_2k.json  second evaluation (context 2048, 256 eval tokens, 12 passages: all the eval text holds)
#   pareto.png          Δppl vs compression ratio of the main evaluation
#   calib/bundle.tar.partNN   the calibration bundle (tar, 15 MiB parts). Reassemble into the repo:
#       mkdir -p checkpoints/gemma3-270m/calib && cat calib/bundle.tar.part* | tar x -C checkpoints/gemma3-270m/calib
# The bundle's manifest.json gets a "release" entry (commit, commands, data, benchmark, metrics of the recipes).
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
OUT=${OUT:-/tmp/codec-out}
RUN=${RUN:-/tmp/codec-run}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
K=build-cuda/kakeya
B=$RUN/calib
mkdir -p "$OUT/calib" "$RUN"
rm -rf "$B"
LOG=$RUN/log.txt
: > "$LOG"

# Calibration: Σ_q (RoPE-averaged over offsets < 2048, capped at the window on sliding
# layers), then PCA bases + Lloyd-Max tables fitted to the residuals of our main recipe.
OURS="kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3"
CAL=(--model "$MODEL" --out "$B" --text data/codec/calib.txt --tokens 65536 --context 2048 --device cuda --bench)
TC0=$(date +%s.%N)
$K calibrate sigma-q "${CAL[@]}" --rope-offsets 2048 2>&1 | tee -a "$LOG"
$K calibrate codebook "${CAL[@]}" --codec "$OURS" 2>&1 | tee -a "$LOG"
TC1=$(date +%s.%N)
CALIB_S=$(python3 -c "print(f'{$TC1 - $TC0:.1f}')")
echo "bench: calibration (sigma-q + codebook, 64k tokens each, incl. model loads) took ${CALIB_S} s on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$LOG"

# Our recipes (shared calibrated PCA basis, reverse water-filling of bits on its spectrum,
# BOS kept exact) and every baseline, on the same passages.
CODECS="exact"
CODECS+=";ours=$OURS"
CODECS+=";ours_cal=$OURS,cal=1"
CODECS+=";ours_k35=kakeya:sink=1,kbasis=calib,kalloc=3.5,vbasis=calib,valloc=3"
CODECS+=";ours_qp=kakeya:sink=1,kqp=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3"
CODECS+=";ours_k3v27=kakeya:sink=1,kbasis=calib,kalloc=3,vbasis=calib,valloc=2.7"
CODECS+=";ours_k128x4+2=kakeya:sink=1,kbasis=calib,kg=128:4+128:2,vbasis=calib,vb=3"
CODECS+=";ours_k160x4+96x2=kakeya:sink=1,kbasis=calib,kg=160:4+96:2,vbasis=calib,vb=3"
CODECS+=";turbo44=turbo:kb=4,vb=4;turbo43=turbo:kb=4,vb=3;turbo33=turbo:kb=3,vb=3;turbo32=turbo:kb=3,vb=2"
CODECS+=";turbo43_sink=turbo:kb=4,vb=3,sink=1;int4;int8;fp8"
EV=(--model "$MODEL" --bundle "$B" --text data/codec/eval.txt --device cuda --codecs "$CODECS")
$K codec-eval "${EV[@]}" --context 1536 --n-eval 224 --passages 16 --json "$OUT/codec_eval.json" --plot "$OUT/pareto.png" \
  --python python3 2> "$RUN/eval1.err" | tee -a "$LOG"
$K codec-eval "${EV[@]}" --context 2048 --n-eval 256 --passages 12 --json "$OUT/codec_eval_2k.json" \
  2> "$RUN/eval2.err" | tee -a "$LOG"

python3 - "$B/manifest.json" "$OUT/codec_eval.json" "$OUT/codec_eval_2k.json" "$COMMIT" "$CALIB_S" "$LOG" <<'PY'
import json, sys
man, e1, e2, commit, calib_s, log = sys.argv[1:]
m = json.load(open(man))
def rows(p):
    r = json.load(open(p))
    return {"context": r["context"], "n_eval": r["n_eval"], "passages": r["passages"], "text": r["text"], "dtype": r["dtype"],
            "command": r["command"],
            "rows": [{k: x[k] for k in ("label", "spec", "bits_per_value", "ratio", "dppl", "top1", "kl")} for x in r["rows"]]}
m["entries"]["release"] = {
    "commit": commit,
    "script": "tools/device/codec_eval.sh",
    "calibration_seconds": float(calib_s),
    "calibration_bench": [l.strip() for l in open(log) if l.startswith("bench:")],
    "recipe": "ours", "eval": [rows(e1), rows(e2)]}
json.dump(m, open(man, "w"), indent=2)
PY
cp "$LOG" "$OUT/table.txt"
rm -f "$OUT"/calib/bundle.tar.part*
tar cf - -C "$B" . | split -b 15M -d - "$OUT/calib/bundle.tar.part"
ls -la "$B" "$OUT" "$OUT/calib"
echo "[codec] call used $(( $(date +%s) - T0 ))s"
