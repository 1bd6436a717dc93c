#!/usr/bin/env bash
# `make demo`: the whole product on the embedded default (Gemma 3 270M) on a CPU, with the
# checkpoints shipped in checkpoints/gemma3-270m/ (drafter, calib, and ftheta once it lands;
# until then a toy f_θ trained here stands in). Jobs, in order:
#   1. generate + score (the plain model)
#   2. the training loop at toy scale: capture -> train f_θ -> calibrate a codec
#   3. decode sessions: ar vs restored (--full-attn exact and codec, and the compact configuration),
#      memory tables; the restored decoder behind the OpenAI API (kakeya serve, through the openai client)
#   4. a short NIAH ladder (512, 1k) against the full-KV oracle
#   5. an alpha sweep (3 alphas)
#   6. the held-out long-context suite at 1k: full-KV oracle vs evict-only vs restored (kakeya eval-long)
# then a summary table (printed and $OUT/summary.md) and the plots ($OUT/*.png).
# Budget: < 30 minutes on an idle 2-core CPU after the downloads (the total is printed).
# Env: BUILD (build), OUT ($BUILD/demo), PY (.venv/bin/python).
set -euo pipefail
BUILD=${BUILD:-build}
OUT=${OUT:-$BUILD/demo}
PY=${PY:-.venv/bin/python}
K=$BUILD/kakeya
MODEL=checkpoints/models/gemma3-270m
SHIPPED=checkpoints/gemma3-270m
mkdir -p "$OUT"
: > "$OUT/times.tsv"
T_START=$(date +%s)

# Runs one job, logs it to $OUT/NAME.log, records its wall time.
job() {
  local name=$1; shift
  local t0=$(date +%s)
  printf '== [%s] %.200s\n' "$name" "$(echo "$*" | head -1)"
  if ! "$@" > "$OUT/$name.log" 2>&1; then
    tail -30 "$OUT/$name.log"
    echo "demo: job '$name' failed (log: $OUT/$name.log)" >&2
    exit 1
  fi
  local dt=$(( $(date +%s) - t0 ))
  printf '%s\t%s\n' "$name" "$dt" >> "$OUT/times.tsv"
  echo "   done in ${dt}s"
}

# 1. The plain model.
job generate $K generate --model $MODEL --prompt "The three most important ideas in computer science are" --max-new-tokens 48
printf 'The lighthouse keeper wrote the weather, the ships and the oil burned into the log every night.\nOver a century the handwriting changed many times, but the order of the entries never did.\n' > "$OUT/score.txt"
job score $K score --model $MODEL --text "$OUT/score.txt" --json "$OUT/score.json"

# 2. The training loop at toy scale (the shipped checkpoints come from the same commands at full scale).
$PY - "$OUT/corpus.jsonl" <<'PY'
import json, sys
text = open("data/codec/calib.txt", encoding="utf-8").read()
paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 400][:12]
with open(sys.argv[1], "w") as f:
    for p in paras:
        f.write(json.dumps({"text": p[:1500]}) + "\n")
PY
rm -rf "$OUT/capture"
job capture $K capture --verifier $MODEL --drafter $SHIPPED/drafter --prompts "$OUT/corpus.jsonl" --max-prompts 12 \
  --max-prompt-tokens 160 --gen-len 16 --out "$OUT/capture" --store-dtype f32 --deflate 0 --bench-seqs 0 \
  --json "$OUT/capture.json"
rm -rf "$OUT/ftheta_toy"
job train_ftheta $K train-ftheta --data "$OUT/capture" --verifier $MODEL --drafter $SHIPPED/drafter \
  --save "$OUT/ftheta_toy" --rank 64 --loss mse --steps 300 --batch 2 --max-len 160 --lr 3e-3 --warmup 20 \
  --heldout 2 --eval-every 100 --plot-python "$PY"
rm -rf "$OUT/calib_toy"
job calibrate $K calibrate codebook --model $MODEL --out "$OUT/calib_toy" --text data/codec/calib.txt \
  --tokens 4096 --context 512 --codec kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3
# The toy bundle codes K/V too: the release recipe on a held-out window, through the toy tables.
job codec_eval $K codec-eval --model $MODEL --bundle "$OUT/calib_toy" --text data/codec/eval.txt \
  --codecs "exact;ours=kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3;int4" \
  --context 512 --n-eval 64 --passages 2 --json "$OUT/codec_eval.json" --plot "$OUT/codec_pareto.png" \
  --python "$PY"

# The shipped f_θ when it exists, the toy one otherwise.
if [ -f $SHIPPED/ftheta/f_theta_config.json ]; then FTHETA=$SHIPPED/ftheta; else FTHETA=$OUT/ftheta_toy; fi
echo "f_θ for the decoder: $FTHETA"
R=(--verifier $MODEL --drafter $SHIPPED/drafter --ftheta "$FTHETA")

# 3. Decode sessions on a prompt past the sliding window (512): sliding layers restore; under
#    --full-attn codec the full-attention layers read positions past the window from lm4 coded rows.
$PY -c 'import sys; t=open("data/codec/eval.txt", encoding="utf-8").read(); print(t[:2600])' > "$OUT/prompt.txt"
P="$(cat "$OUT/prompt.txt")"
job decode_ar $K decode "${R[@]}" --mode ar --prompt "$P" --max-new-tokens 32 --json "$OUT/decode_ar.json"
job decode_exact $K decode "${R[@]}" --mode restored --full-attn exact --prompt "$P" --max-new-tokens 32 \
  --compare-ar --json "$OUT/decode_exact.json"
job decode_codec $K decode "${R[@]}" --mode restored --full-attn codec --prompt "$P" --max-new-tokens 32 \
  --compare-ar --json "$OUT/decode_codec.json"
grep -A14 "^memory at" "$OUT/decode_codec.log" | head -16 || true
#    The compact configuration: window 64, each evicted position's exact K/V kept as int6 rows, the
#    full-attention history in the codes the shipped calibration bundle chose (--full-code auto).
job decode_compact $K decode "${R[@]}" --mode restored --window 64 --mix-alpha 1 --restored-code int6 --full-attn codec \
  --full-code auto --prompt "$P" --max-new-tokens 32 --compare-ar --json "$OUT/decode_compact.json"
grep -A14 "^memory at" "$OUT/decode_compact.log" | head -16 || true
job serve $PY tools/serve_demo.py --kakeya $K -- "${R[@]}" --mode restored \
  --chat-template checkpoints/chat_templates/gemma.jinja --max-context 1024
cat "$OUT/serve.log"

# 4. NIAH ladder (short), the full-KV oracle on the same samples.
job niah $K niah "${R[@]}" --full-attn codec --contexts 512,1024 --depths 0.25,0.75 --samples 1 \
  --max-new-tokens 12 --json "$OUT/niah.json" --plot "$OUT/niah.png" --python "$PY"

# 5. Alpha sweep: recall, perplexity and restored-K/V error per mixing alpha.
job sweep_alpha $K sweep-alpha "${R[@]}" --alphas 0,0.5,1 --contexts 512 --depths 0.5 --samples 1 \
  --max-new-tokens 12 --ppl-text data/codec/eval.txt --ppl-tokens 384 --json "$OUT/sweep.json" \
  --plot "$OUT/sweep.png" --python "$PY"

# 6. Held-out suite (data/longeval: sources no training saw) at 1k: does restoring beat dropping?
job eval_long $K eval-long "${R[@]}" --configs oracle,evict:256,restored:256 --tasks niah_single_digits,niah_multikey \
  --contexts 1024 --samples 1 --ppl-docs 2 --ppl-tail 256 --json "$OUT/eval_long.json" --plot "$OUT/eval_long.png" \
  --python "$PY"

TOTAL=$(( $(date +%s) - T_START ))
printf 'total\t%s\n' "$TOTAL" >> "$OUT/times.tsv"
$PY tools/demo_summary.py "$OUT" "$FTHETA"
echo "demo: total ${TOTAL}s ($(( TOTAL / 60 ))m $(( TOTAL % 60 ))s) on $(nproc) cores; summary $OUT/summary.md, plots $OUT/*.png"
