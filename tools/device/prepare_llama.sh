#!/usr/bin/env bash
# Run here (not on the GPU machine): stage llama.cpp's source for the llama.cpp peer of
# `kakeya bench decode` (tools/device/llama_bench.sh builds and runs it there). The source is the
# one vendored in PyPI's llama-cpp-python sdist (~76 MB); only what a CUDA build of llama-bench
# and llama-quantize reads travels: ggml (CPU and CUDA backends), src, include, common, vendor,
# cmake, the tools' CMake files and sources (without the server's web UI), ~5 MB compressed.
#   .carry/llama/llama.cpp.tar.xz   .carry/llama/VERSION
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
OUT=.carry/llama
mkdir -p "$OUT"
if [ -f "$OUT/llama.cpp.tar.xz" ] && [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  ls -la "$OUT"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "prepare_llama: no vendor/llama.cpp in llama-cpp-python $VERSION" >&2; exit 1; }
# Backends other than CPU and CUDA are only entered when enabled; the server's web UI is not built.
tar cJf "$OUT/llama.cpp.tar.xz" -C "$src" \
  --exclude='ggml/src/ggml-metal' --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-sycl' \
  --exclude='ggml/src/ggml-opencl' --exclude='ggml/src/ggml-hexagon' --exclude='ggml/src/ggml-cann' \
  --exclude='ggml/src/ggml-et' --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-musa' \
  --exclude='ggml/src/ggml-zdnn' --exclude='ggml/src/ggml-zendnn' --exclude='ggml/src/ggml-openvino' \
  --exclude='ggml/src/ggml-virtgpu' --exclude='tools/ui' --exclude='*.png' --exclude='*.jpg' \
  CMakeLists.txt LICENSE app cmake common ggml include src vendor tools licenses
echo "$VERSION" > "$OUT/VERSION"
ls -la "$OUT"
