#!/usr/bin/env bash
# Builds libFuzzer targets with clang++ directly (fuzz targets are torch-free,
# so no CMake or LibTorch) and runs each for SECONDS on its corpus.
#
# Usage: tools/fuzz/run_fuzz.sh TARGET|all SECONDS
#
# TARGET NAME is tools/fuzz/fuzz_NAME.cpp; the project sources it links are
# listed in that file on one line "// FUZZ_SOURCES: core/a.cpp core/b.cpp".
# Committed seeds: tools/fuzz/corpus/NAME/; dictionary: tools/fuzz/NAME.dict
# (optional). New corpus entries and crash artifacts go to build-fuzz/NAME/;
# the script exits non-zero if any target finds a crash.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ $# -ne 2 ]]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
target=$1 seconds=$2
CXX=${CXX:-clang++}

if [[ $target == all ]]; then
  targets=$(ls tools/fuzz/fuzz_*.cpp | sed 's|.*/fuzz_||; s|\.cpp$||')
else
  targets=$target
fi

status=0
for t in $targets; do
  src=tools/fuzz/fuzz_$t.cpp
  [[ -f $src ]] || { echo "no fuzz target $src" >&2; exit 2; }
  out=build-fuzz/$t
  mkdir -p "$out/corpus" "tools/fuzz/corpus/$t"
  deps=$(sed -n 's|^// FUZZ_SOURCES: *||p' "$src")
  echo "== building fuzz_$t ($src $deps)"
  # -O1 keeps ASan fast; UBSan aborts so that libFuzzer records the input.
  # shellcheck disable=SC2086
  $CXX -std=c++17 -g -O1 -I. -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$src" $deps -o "$out/fuzz_$t"
  dict=()
  [[ -f tools/fuzz/$t.dict ]] && dict=(-dict="tools/fuzz/$t.dict")
  echo "== running fuzz_$t for ${seconds}s"
  if ! "$out/fuzz_$t" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$out/" "$out/corpus" "tools/fuzz/corpus/$t"; then
    echo "fuzz_$t FAILED: reproduce with $out/fuzz_$t $out/crash-*" >&2
    status=1
  fi
done
exit $status
