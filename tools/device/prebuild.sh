#!/usr/bin/env bash
# Run here (not on the GPU machine): build the GPU machine's binaries with this machine's nvcc and
# the .venv's LibTorch (the same torch wheel the GPU machine has), so a lease spends no device time
# building (a build on a fresh lease takes ~250 of its seconds). Packs the stripped
# build-cuda/{kakeya, tests/test_cuda_*} (every GPU suite) into .carry/prebuilt/$NAME.tgz
# (carry .carry/prebuilt, then `tools/device/remote.sh prebuilt` in /tmp/ksrc unpacks and checks them).
# The binaries find the GPU machine's LibTorch (and the CUDA runtime beside it) through RPATH entries:
# DEVICE_TORCH_LIB and its wheel's nvidia/cu13/lib.
# Env: DEVICE_TORCH_LIB (/opt/torch/.venv/lib/python3.12/site-packages/torch/lib), JOBS (nproc),
#      NAME (kakeya-cuda: the package .carry/prebuilt/NAME.tgz; another name keeps a variant beside it).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE_TORCH_LIB=${DEVICE_TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
[ -x .venv/bin/python ] || { echo "prebuild.sh: no .venv here: run make build (or tools/bootstrap.sh) first"; exit 1; }
TORCH_CMAKE=$(.venv/bin/python -c 'import torch;print(torch.utils.cmake_prefix_path)')
TORCH_VERSION=$(.venv/bin/python -c 'import torch;print(torch.__version__)')
case $TORCH_VERSION in
  *+cu*) ;;
  *) echo "prebuild.sh: the .venv's torch is $TORCH_VERSION, not a CUDA build: its binaries could not run on the GPU machine"; exit 1 ;;
esac
# cpp-httplib as the GPU machine has it: the carried single header (Debian's split library is not there;
# -U drops what an earlier configure of build-cuda cached from pkg-config).
[ -f .carry/include/httplib.h ] || { echo "prebuild.sh: no .carry/include/httplib.h: run tools/device/prepare.sh first"; exit 1; }
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON -DKAKEYA_TESTS=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON -U "CPP_HTTPLIB*" -U __pkg_config_checked_CPP_HTTPLIB \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DCMAKE_BUILD_RPATH="$DEVICE_TORCH_LIB;$DEVICE_TORCH_LIB/../../nvidia/cu13/lib" > /tmp/prebuild-cmake.log 2>&1 ||
  { tail -30 /tmp/prebuild-cmake.log; exit 1; }
TESTS="test_cuda_ops test_cuda_restored test_cuda_drafter test_cuda_gemma4 test_cuda_megakernel test_cuda_head_screen"  # every GPU suite (label gpu)
cmake --build build-cuda -j "${JOBS:-$(nproc)}" --target kakeya $TESTS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/build-cuda/tests" .carry/prebuilt
strip -o "$tmp/build-cuda/kakeya" build-cuda/kakeya
for t in $TESTS; do strip -o "$tmp/build-cuda/tests/$t" "build-cuda/tests/$t"; done
# What remote.sh prebuilt checks before it lets a lease use them, and what a result names as its tree.
dirty=$(git diff --quiet HEAD -- . ':!checkpoints' 2>/dev/null || echo "+uncommitted")
cat > "$tmp/build-cuda/PREBUILT" <<EOF
commit $(git rev-parse --short HEAD)$dirty
torch $TORCH_VERSION
torch_lib $DEVICE_TORCH_LIB
built $(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
tar -C "$tmp" -czf ".carry/prebuilt/${NAME:-kakeya-cuda}.tgz" build-cuda
ls -la ".carry/prebuilt/${NAME:-kakeya-cuda}.tgz"
cat "$tmp/build-cuda/PREBUILT"
