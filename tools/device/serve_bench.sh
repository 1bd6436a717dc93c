#!/usr/bin/env bash
# Batched decoding of `kakeya serve` under concurrent clients, on the GPU machine, after the model is staged
# (tools/device/remote.sh recv … model) and build-cuda/ holds kakeya:
#   1. kakeya serve $MODE_FLAGS --batch $BATCH: tools/serve_load.py at concurrency $LEVELS (~$PROMPT_TOKENS-token
#      distinct prompts, $NEW_TOKENS new tokens, greedy) → $OUT/serve-load-batch.json (aggregate tok/s, ratio to
#      concurrency 1)
#   2. the same server with --batch 1 (the unbatched worker, the baseline) at $LEVELS1 → $OUT/serve-load-batch1.json
#   3. batched / unbatched aggregate tok/s at the levels both ran
# The servers' stderr: $OUT/serve-batch<N>.log. The server is killed on exit, whatever happens.
# Env: MODEL (/tmp/models/gemma3-270m), OUT ($OUT or /tmp/serve-bench-out), B (build-cuda), DTYPE (bf16),
#      BATCH (64), LEVELS (1,4,16,64), LEVELS1 (1,4; empty: no --batch 1 run), MODE_FLAGS (--mode ar),
#      MAX_CONTEXT (1024), PROMPT_TOKENS (512), NEW_TOKENS (256).
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
B=${B:-build-cuda}
OUT=${OUT:-/tmp/serve-bench-out}
mkdir -p "$OUT"
DTYPE=${DTYPE:-bf16}
MODE_FLAGS=${MODE_FLAGS:---mode ar}
MAX_CONTEXT=${MAX_CONTEXT:-1024}
PROMPT_TOKENS=${PROMPT_TOKENS:-512}
NEW_TOKENS=${NEW_TOKENS:-256}
SRV=
stop_server() {  # SIGTERM (the server stops cleanly), SIGKILL after 30 s
  [ -n "$SRV" ] || return 0
  kill "$SRV" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$SRV" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$SRV" 2>/dev/null || true
  wait "$SRV" 2>/dev/null || true
  SRV=
}
trap stop_server EXIT

bench() {  # bench <--batch> <levels> <json>
  local n=$1 levels=$2 json=$3 log=$OUT/serve-batch$1 port='' name rc=0
  # shellcheck disable=SC2086  # MODE_FLAGS: several words
  "$B"/kakeya serve --model "$MODEL" --device cuda --dtype "$DTYPE" $MODE_FLAGS --port 0 --max-context "$MAX_CONTEXT" \
    --batch "$n" --max-queue 256 > "$log.stdout" 2> "$log.log" &
  SRV=$!
  for _ in $(seq 240); do  # the "PORT <n>" line, up to 120 s (model load)
    port=$(sed -n 's/^PORT \([0-9][0-9]*\)$/\1/p' "$log.stdout")
    [ -n "$port" ] && break
    kill -0 "$SRV" 2>/dev/null || { echo "kakeya serve --batch $n exited before PORT:"; tail -20 "$log.log"; exit 1; }
    sleep 0.5
  done
  [ -n "$port" ] || { echo "kakeya serve --batch $n: no PORT line in 120 s"; tail -20 "$log.log"; exit 1; }
  name=$(python3 -c 'import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1], timeout=30))["data"][0]["id"])' "http://127.0.0.1:$port/v1/models")
  echo "== kakeya serve $MODE_FLAGS --batch $n (port $port, model $name), concurrency $levels"
  local rss0 rss1
  rss0=$(awk '/VmRSS/ {print $2}' /proc/$SRV/status)
  python3 tools/serve_load.py --url "http://127.0.0.1:$port/v1" --model "$name" --concurrency "$levels" \
    --prompt-tokens "$PROMPT_TOKENS" --new-tokens "$NEW_TOKENS" --json "$json" || rc=$?
  rss1=$(awk '/VmRSS/ {print $2}' /proc/$SRV/status)
  # The highest level once more on the same server: a second sample, and memory that grows per load shows.
  python3 tools/serve_load.py --url "http://127.0.0.1:$port/v1" --model "$name" --concurrency "${levels##*,}" \
    --prompt-tokens "$PROMPT_TOKENS" --new-tokens "$NEW_TOKENS" --seed 1 --json "${json%.json}-again.json" |
    grep -E '^ +[0-9]' || rc=$?
  local rss2
  rss2=$(awk '/VmRSS/ {print $2}' /proc/$SRV/status)
  echo "serve_load (--batch $n) exit $rc; server RSS before the load $((rss0 / 1024)) MiB, after it $((rss1 / 1024)) MiB," \
    "after the last level again $((rss2 / 1024)) MiB; KV bytes (every session)" \
    "$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["metrics"].get("kakeya_kv_bytes_total"))' "$json")"
  stop_server
}

bench "${BATCH:-64}" "${LEVELS:-1,4,16,64}" "$OUT/serve-load-batch.json"
LEVELS1=${LEVELS1-1,4}
[ -n "$LEVELS1" ] || exit 0
bench 1 "$LEVELS1" "$OUT/serve-load-batch1.json"
python3 - "$OUT" <<'PY'
import json, sys
agg = lambda f: {l["concurrency"]: l["aggregate_tok_s"] for l in json.load(open(f"{sys.argv[1]}/{f}"))["levels"]}
b, b1 = agg("serve-load-batch.json"), agg("serve-load-batch1.json")
for n in sorted(set(b) & set(b1)):
    print(f"concurrency {n}: batched {b[n]:.1f} tok/s, --batch 1 {b1[n]:.1f} tok/s, x{b[n] / b1[n] if b1[n] else float('nan'):.2f}")
PY
