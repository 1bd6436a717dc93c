#!/usr/bin/env bash
# Where the restored decoder's GPU time goes (ncu; run from the repo root through the device
# tool, after tools/device/remote.sh has built build-cuda/kakeya and converted the model):
#   STEP=decode  tools/device/attn_profile.sh  # the first 144 attention kernels of `kakeya decode` on an
#                                              # ~8k prompt: AR, int4 regions, lm4 and pw4 full-attention rows
#   STEP=prefill tools/device/attn_profile.sh  # 2,000 consecutive kernels in the middle of the restored
#                                              # prefill (window 64, chunk 64, int4 regions, pw4 rows),
#                                              # summed per kernel and per chunk
#   STEP=step    tools/device/attn_profile.sh  # every kernel of one AR decode step on a ~1k prompt, summed
#                                              # per kernel (the run's last step); STEP_ARGS: the decode's mode
#                                              # flags instead of --mode ar, CHARS: the prompt's characters of
#                                              # data/longeval/docs/01.txt (4000; 30000 is ~8k tokens),
#                                              # STEP_NAME: the CSV's name (ar), NEW: tokens decoded (4; a fused
#                                              # decode needs a few blocks for its last one to show)
# ncu runs with --cache-control none --clock-control none so a kernel's time is close to its time
# in the run (small kernels keep their warm L2); every run prints its command first.
# Env: KAKEYA (the binary profiled, build-cuda/kakeya: another package's, e.g. a reference unpacked beside it),
# MODEL (/tmp/models/gemma3-270m), OUT ($OUT or /tmp/attn-profile), RCODE (the restored regions' code,
# int4), FCODE (the full-attention rows' code of STEP=prefill, pw4).
set -euo pipefail
MODEL=${MODEL:-/tmp/models/gemma3-270m}
OUT=${OUT:-/tmp/attn-profile}
mkdir -p "$OUT"
K=${KAKEYA:-build-cuda/kakeya}
python3 -c "
import json; t = open('data/longeval/docs/00.txt').read()[:30000]
open('/tmp/attn-profile-prompt.jsonl', 'w').write(json.dumps({'prompt': t}) + '\n')"
R=(--device cuda --verifier "$MODEL" --prompts /tmp/attn-profile-prompt.jsonl)
W=(--mode restored --window 64 --chunk 64 --restored-code "${RCODE:-int4}")
NCU=(ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none --clock-control none)

# Sum a CSV of ncu rows per (kernel, grid): count, mean and total microseconds. LAST_STEP=1: only
# the run's last decode step (graph replays repeat one kernel sequence: the shortest period the
# run's tail repeats).
summarize() {
  LAST_STEP=${LAST_STEP:-0} python3 - "$1" <<'PY'
import csv, os, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if os.environ["LAST_STEP"] == "1":
    names = [r["Kernel Name"] + r["Grid Size"] for r in rows]
    period = next((p for p in range(8, len(names) // 2 + 1) if names[-p:] == names[-2 * p:-p]), None)
    if period is None:
        sys.exit(f"no repeated decode step among the {len(rows)} kernels profiled")
    rows = rows[-period:]
    print(f"last decode step: {period} kernels")
us = lambda r: float(r["Metric Value"].replace(",", ""))  # ns, with thousands separators
agg = collections.OrderedDict()
for r in rows:
    key = (r["Kernel Name"].split("(")[0].split("<")[0][:48], r["Grid Size"])
    agg.setdefault(key, []).append(us(r) / 1e3)
for (name, grid), t in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
    print(f"{sum(t) / len(t):10.2f} us x {len(t):4d} = {sum(t):9.1f} us  {name} grid {grid}")
total = sum(us(r) for r in rows) / 1e3
print(f"kernels: {len(rows)}, total {total:.1f} us")
# Chunks of the prefill: the restore store runs once a chunk.
marks = [i for i, r in enumerate(rows) if "restore_store" in r["Kernel Name"]]
if len(marks) > 2:
    per = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]
    chunk_us = [sum(us(r) for r in rows[marks[i]:marks[i + 1]]) / 1e3 for i in range(len(marks) - 1)]
    print(f"chunks: {len(per)} whole; kernels per chunk {per}; GPU us per chunk {[round(u, 1) for u in chunk_us]}")
PY
}

case ${STEP:-decode} in
  decode)
    run() {
      echo "== $N: ${NCU[*]} -k regex:decode_attn -c 144 $K decode ${R[*]} --max-new-tokens 8 $*"
      "${NCU[@]}" -k regex:decode_attn -c 144 $K decode "${R[@]}" --max-new-tokens 8 "$@" > "$OUT/ncu_$N.csv" 2> "$OUT/ncu_$N.err" ||
        tail -5 "$OUT/ncu_$N.err"
      summarize "$OUT/ncu_$N.csv"
    }
    N=ar run --mode ar
    N=int4 run "${W[@]}"
    N=lm4 run "${W[@]}" --full-attn codec --full-code lm4
    N=pw4 run "${W[@]}" --full-attn codec --full-code pw4
    ;;
  prefill)
    # An 8k prompt is 128 chunks of ~830 kernels, too many to profile one by one: skip into the prompt.
    SKIP=${SKIP:-20000}
    echo "== ${NCU[*]} --launch-skip $SKIP -c 2000 $K decode ${R[*]} --max-new-tokens 1 ${W[*]} --full-attn codec --full-code ${FCODE:-pw4}"
    "${NCU[@]}" --launch-skip "$SKIP" -c 2000 $K decode "${R[@]}" --max-new-tokens 1 "${W[@]}" --full-attn codec \
      --full-code "${FCODE:-pw4}" > "$OUT/ncu_prefill.csv" 2> "$OUT/ncu_prefill.err" || tail -5 "$OUT/ncu_prefill.err"
    summarize "$OUT/ncu_prefill.csv"
    ;;
  step)
    python3 -c "
import json; t = open('data/longeval/docs/01.txt').read()[:${CHARS:-4000}]
open('/tmp/attn-profile-prompt.jsonl', 'w').write(json.dumps({'prompt': t}) + '\n')"
    read -r -a A <<< "${STEP_ARGS:---mode ar}"
    N=${STEP_NAME:-ar}
    echo "== ${NCU[*]} $K decode ${R[*]} --max-new-tokens ${NEW:-4} ${A[*]}"
    "${NCU[@]}" $K decode "${R[@]}" --max-new-tokens "${NEW:-4}" "${A[@]}" > "$OUT/ncu_step_$N.csv" 2> "$OUT/ncu_step_$N.err" ||
      tail -5 "$OUT/ncu_step_$N.err"
    LAST_STEP=1 summarize "$OUT/ncu_step_$N.csv"
    ;;
  *) echo "STEP: decode, prefill or step, got ${STEP}"; exit 2 ;;
esac
