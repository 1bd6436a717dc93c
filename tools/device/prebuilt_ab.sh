#!/usr/bin/env bash
# Two or more prebuilt binaries (tools/device/prebuild.sh NAME=...) timed and tested in one lease, in turn
# (leases differ by a few percent, so a change is judged against its reference on the same machine). Run
# on the GPU machine from the repo root through the device tool, after the model is staged (README, "On the
# GPU machine"; /tmp/models/gemma3-270m). Each STEP takes the packages' names as arguments (the first is
# the reference) and writes its files under $RES, packed into $OUT/ab.tgz at the end of the call (the device
# tool brings back few files):
#   STEP=unpack  names...  carry .carry/prebuilt/NAME.tgz (~21 MB each) in this or earlier calls; once
#                          every named package is there, each is checked and unpacked into /tmp/ab-NAME
#                          (remote.sh prebuilt)
#   STEP=tests   names...  every GPU suite on each binary (compact_eval.sh STEP=tests; the real model
#                          for the suites that load it)
#   STEP=decode  names...  kakeya bench decode --head-screen on the real model at PROMPTS (512 8192),
#                          ROUNDS (2) rounds, the binaries in turn within each round
#   STEP=spec    names...  kakeya bench spec --modes ar,fused (the shipped drafter: in the tree)
#   STEP=parity  names...  tools/parity_check.py in bf16
# Env: MODEL (/tmp/models/gemma3-270m), RES (/tmp/ab-res), PROMPTS, ROUNDS, REPEATS (3).
set -uo pipefail
STEP=${STEP:-tests}
MODEL=${MODEL:-/tmp/models/gemma3-270m}
RES=${RES:-/tmp/ab-res}
SRC=/tmp/ksrc
[ $# -gt 0 ] || { echo "prebuilt_ab.sh: name the packages (.carry/prebuilt/NAME.tgz), the reference first"; exit 2; }
mkdir -p "$RES"
bash tools/device/sync_src.sh | tail -1
cd $SRC
use() {  # the binary of package $1 as build-cuda (the tests and tools look there)
  [ -x /tmp/ab-$1/kakeya ] || { echo "prebuilt_ab.sh: package $1 is not unpacked (STEP=unpack first)"; exit 1; }
  ln -sfn /tmp/ab-$1 build-cuda
}
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/ab.tgz" -C "$RES" . && echo "[ab] $(ls "$RES" | wc -l) files in \$OUT/ab.tgz"; }
rc=0
case $STEP in
  unpack)
    # sync_src.sh mirrors .carry/prebuilt too, and keeps what earlier calls carried.
    for n in "$@"; do [ -f .carry/prebuilt/$n.tgz ] || { echo "[ab] $n: not here yet (carry .carry/prebuilt/$n.tgz)"; exit 0; }; done
    mkdir -p checkpoints/models
    ln -sfn "$MODEL" checkpoints/models/gemma3-270m
    for n in "$@"; do
      rm -rf build-cuda /tmp/ab-$n
      PREBUILT=$n bash tools/device/remote.sh prebuilt > $RES/unpack-$n.txt 2>&1 || { cat $RES/unpack-$n.txt; exit 1; }
      echo "[ab] $n: $(head -1 $RES/unpack-$n.txt)"
      mv build-cuda /tmp/ab-$n
    done ;;
  tests)
    export KAKEYA_FIXTURES=$SRC/tests/fixtures
    for n in "$@"; do
      use $n
      echo "== $n"
      STEP=tests OUT=$RES TAG=$n TESTS=$(cd build-cuda/tests && ls test_cuda_* | paste -sd '|') \
        bash tools/device/compact_eval.sh || rc=1
    done ;;
  decode)
    for r in $(seq 1 "${ROUNDS:-2}"); do
      for p in ${PROMPTS:-512 8192}; do
        for n in "$@"; do
          use $n
          f=$RES/decode-$n-$p-r$r
          build-cuda/kakeya bench decode --device cuda --model "$MODEL" --prompt-len $p --new-tokens 256 \
            --repeats "${REPEATS:-3}" --head-screen --no-peer --json $f.json > $f.txt 2>&1 || { rc=1; tail -3 $f.txt; }
          echo "== $n, prompt $p, round $r"
          grep -E "kakeya ar|bound" $f.txt
        done
      done
    done ;;
  spec)
    for n in "$@"; do
      use $n
      f=$RES/spec-$n
      build-cuda/kakeya bench spec --device cuda --verifier "$MODEL" --modes ar,fused --prompts 4 --new-tokens 128 \
        --niah-contexts '' --json $f.json > $f.txt 2>&1 || { rc=1; tail -5 $f.txt; }
      echo "== $n"
      grep -E "^(set|code|prose) " $f.txt
    done ;;
  parity)
    for n in "$@"; do
      use $n
      f=$RES/parity-$n
      python3 tools/parity_check.py --model "$MODEL" --kakeya build-cuda/kakeya --device cuda --dtype bf16 \
        --json $f.json > $f.txt 2>&1 || rc=1
      echo "== $n"
      tail -2 $f.txt
    done ;;
  *) echo "prebuilt_ab.sh: STEP is unpack, tests, decode, spec or parity, got $STEP"; exit 2 ;;
esac
pack
exit $rc
