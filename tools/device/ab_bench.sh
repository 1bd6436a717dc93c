#!/usr/bin/env bash
# Two versions of the code timed in one lease (leases differ by a few percent, so a change's speed is
# judged against its reference on the same machine, in turn). Run on the GPU machine in /tmp/ksrc after
# sync_src.sh, through the device tool:
#   STEP=start tools/device/ab_bench.sh  copy /tmp/ksrc to /tmp/ksrc-ref with the files under $REF
#                                        (tools/device/ab_ref: the reference's versions at their repo paths,
#                                        e.g. tools/device/ab_ref/core/kernels/cuda/decode_ops.cu, carried as
#                                        untracked files) in place, and build its kakeya in the background
#                                        (remote.sh build, log /tmp/kbuild-ref.log); start it in the call that starts remote.sh build
#   STEP=bench tools/device/ab_bench.sh <bench memory flags>
#                                        wait for both builds, then run `kakeya bench memory <flags>` with
#                                        the working tree's binary and the reference's in turn, $REPEATS times
#                                        (2), into $OUT/ab-{new,ref}-rN.json (the device tool brings back few
#                                        files a call), and print each config's decode and prefill tok/s
# Env: REF (tools/device/ab_ref), REPEATS (2), OUT ($OUT or /tmp/ab-bench).
set -euo pipefail
REF=${REF:-tools/device/ab_ref}
OUT=${OUT:-/tmp/ab-bench}
case ${STEP:-bench} in
  start)
    [ -d "$REF" ] || { echo "ab_bench: no $REF here (the reference's files at their repo paths)"; exit 2; }
    rm -rf /tmp/ksrc-ref && cp -a /tmp/ksrc /tmp/ksrc-ref && rm -rf /tmp/ksrc-ref/build-cuda
    (cd "$REF" && find . -type f -print0) | while IFS= read -r -d '' f; do cp "$REF/$f" "/tmp/ksrc-ref/${f#./}"; done
    (cd /tmp/ksrc-ref && LOG=/tmp/kbuild-ref.log KAKEYA_TESTS=OFF KAKEYA_TARGETS=kakeya bash tools/device/remote.sh build)
    echo "reference: $(cd "$REF" && find . -type f | wc -l) files from $REF" ;;
  bench)
    mkdir -p "$OUT"
    bash tools/device/remote.sh wait > /dev/null
    LOG=/tmp/kbuild-ref.log bash tools/device/remote.sh wait > /dev/null || { tail -20 /tmp/kbuild-ref.log; exit 1; }
    for r in $(seq 1 "${REPEATS:-2}"); do
      for v in new ref; do
        K=build-cuda/kakeya; [ $v = ref ] && K=/tmp/ksrc-ref/build-cuda/kakeya
        if ! $K bench memory "$@" --json "$OUT/ab-$v-r$r.json" > /tmp/ab-$v-r$r.txt 2>&1; then
          tail -5 /tmp/ab-$v-r$r.txt; exit 1
        fi
        python3 - "$OUT/ab-$v-r$r.json" "$v r$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"== {sys.argv[2]} (context {d['context']})")
for c in d["configs"]:
    if "decode_tps" not in c:
        sys.exit("ab_bench: no timings in the JSON (pass --speed)")
    print(f"  {c['config']:<32} decode {c['decode_tps']:8.1f} ({c['decode_ratio_vs_ar']:.3f}x)  "
          f"prefill {c['prefill_tps']:9.0f} ({c['prefill_ratio_vs_ar']:.3f}x)")
PY
      done
    done ;;
  *) echo "STEP: start or bench, got ${STEP}"; exit 2 ;;
esac
