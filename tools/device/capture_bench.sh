#!/usr/bin/env bash
# Capture on the GPU machine: the cost of `kakeya capture` vs the verifier alone
# (issue 4 target: capture <= 2x), plus a small capture read back by h5py.
# Run from the repo root through the device tool (one call, < 9 min):
#   tools/device/capture_bench.sh
# Env: MODEL (default /tmp/models/gemma3-270m, made by tools/device/remote.sh model),
#      DRAFTER (default checkpoints/gemma3-270m/drafter), GEN_LEN (default 256), NIAH (default 8),
#      SEQS (corpus prompts, default 8).
# Writes $OUT/capture_report.json, $OUT/capture.log, $OUT/h5py_check.txt.
# Needs HDF5 C headers + library (libhdf5-dev); without them the build skips `kakeya capture`
# and this script stops with a message saying so.
set -euo pipefail
T0=$(date +%s)
MODEL=${MODEL:-/tmp/models/gemma3-270m}
DRAFTER=${DRAFTER:-checkpoints/gemma3-270m/drafter}
GEN_LEN=${GEN_LEN:-256}
NIAH=${NIAH:-8}
SEQS=${SEQS:-8}
OUT=${OUT:-/tmp/capture-out}
RUN=/tmp/capture-run
mkdir -p "$OUT"

if [ ! -f build-cuda/build.ninja ]; then
  TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > /tmp/capture-cmake.log 2>&1 || { tail -30 /tmp/capture-cmake.log; exit 1; }
fi
cmake --build build-cuda -j 16 --target kakeya > /tmp/capture-build.log 2>&1 || { tail -50 /tmp/capture-build.log; exit 1; }
if ! build-cuda/kakeya capture --help > /dev/null 2>&1; then
  echo "[capture] this build has no 'kakeya capture': HDF5 (libhdf5-dev) was not found at configure time"
  grep -i hdf5 /tmp/capture-cmake.log build-cuda/CMakeCache.txt | head -5 || true
  exit 2
fi
echo "[capture] kakeya built at +$(( $(date +%s) - T0 ))s"

# Corpus prompts: paragraphs of the Python documentation topics (the codec's eval text).
python3 - "$SEQS" > "$RUN.prompts.txt" <<'PY'
import sys
paras = [p.strip() for p in open("data/codec/eval.txt").read().split("\n\n") if len(p.strip()) > 200]
print("\n\n".join(paras[: int(sys.argv[1])]))
PY
rm -rf "$RUN"
build-cuda/kakeya capture --device cuda --verifier "$MODEL" --drafter "$DRAFTER" \
  --prompts "$RUN.prompts.txt" --niah "$NIAH" --niah-min-tokens 512 --niah-max-tokens 1024 \
  --gen-len "$GEN_LEN" --out "$RUN" --seqs-per-shard 4 --bench-seqs 4 --json "$OUT/capture_report.json" \
  2>&1 | tr '\r' '\n' | tee "$OUT/capture.log" | tail -4

# h5py reads the bf16 shards back (bit patterns -> bfloat16) and they are finite.
python3 - "$RUN" > "$OUT/h5py_check.txt" 2>&1 <<'PY' || true
import json, sys
from pathlib import Path
import h5py, numpy as np
d = Path(sys.argv[1]); m = json.loads((d / "capture.json").read_text())
n = 0
for sh in m["shards"]:
    with h5py.File(d / sh["file"], "r") as f:
        for name in f:
            k = f[name]["layer_00/k"]; a = k[()]
            x = (a.astype(np.uint32) << 16).view(np.float32)
            assert np.isfinite(x).all(), name
            n += 1
print(f"h5py read {n} sequences, store_dtype {m['identity']['store_dtype']}, {m['tokens']} tokens, {m['bytes']/1e6:.1f} MB")
PY
cat "$OUT/h5py_check.txt"
cp "$RUN/capture.json" "$OUT/"
echo "[capture] done at +$(( $(date +%s) - T0 ))s"
