#!/usr/bin/env bash
# llama.cpp as the peer of `kakeya bench decode` on the GPU machine. Run from the repo root through
# the device tool, with .carry/llama (tools/device/prepare_llama.sh) carried; a warm machine keeps
# /tmp/llama between calls. Steps:
#   STEP=build   unpack the source, configure (CUDA, sm_90) and build llama-bench + llama-quantize in the
#                background (log /tmp/llama/build.log; ~5 min on 16 cores)
#   STEP=wait    wait for that build
#   STEP=models  the default model's BF16 GGUF from its Q4_K_M one (llama-quantize --allow-requantize)
#   STEP=bench   kakeya bench decode with the HF peer and llama.cpp on both GGUFs, same run
#                (PROMPT_LEN 512, NEW_TOKENS 256, REPEATS 5, JSON $OUT/bench_decode_llama.json)
# The model's GGUF files are under /tmp/models (tools/device/remote.sh recv + model).
set -euo pipefail
L=/tmp/llama
M=/tmp/models
Q4=$M/gemma-3-270m-q4_k_m.gguf
BF16=$M/gemma-3-270m-bf16.gguf
case ${STEP:-build} in
  build)
    mkdir -p $L/src
    tar xJf .carry/llama/llama.cpp.tar.xz -C $L/src
    setsid nohup bash -c "cmake -S $L/src -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF && cmake --build $L/build -j 16 --target llama-bench llama-quantize; \
        echo BUILD_EXIT=\$?" > $L/build.log 2>&1 < /dev/null &
    echo "llama.cpp build started ($(cat .carry/llama/VERSION) sdist)" ;;
  wait)
    while ! grep -q BUILD_EXIT $L/build.log 2>/dev/null; do sleep 2; done
    tail -3 $L/build.log
    grep -q BUILD_EXIT=0 $L/build.log ;;
  models)
    [ -f $BF16 ] || $L/build/bin/llama-quantize --allow-requantize $Q4 $BF16 BF16 > $L/quantize.log 2>&1 \
      || { tail -20 $L/quantize.log; exit 1; }
    ls -la $Q4 $BF16 ;;
  bench)
    build-cuda/kakeya bench decode --device cuda --model $M/gemma3-270m --prompt-len "${PROMPT_LEN:-512}" \
      --new-tokens "${NEW_TOKENS:-256}" --repeats "${REPEATS:-5}" --llama-bench $L/build/bin/llama-bench \
      --gguf $BF16,$Q4 --json "${OUT:-/tmp}/bench_decode_llama.json" ;;
  *) echo "unknown STEP=$STEP (build | wait | models | bench)"; exit 2 ;;
esac
