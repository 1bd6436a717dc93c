#!/usr/bin/env bash
# Run on the GPU machine, from the repo root, through the device tool. Steps:
#   recv             copy the carried .carry/parts/gguf.partNN into /tmp/models (one chunk per call)
#   build            configure + build with CUDA into build-cuda/ (in the background; log $LOG, default /tmp/kbuild.log;
#                    $KAKEYA_TARGETS limits the targets, $KAKEYA_TESTS=OFF skips the test suite)
#   model            reassemble the GGUF, check its sha256, convert to /tmp/models/gemma3-270m
#   wait             wait for the background build (of log $LOG)
#   prebuilt         unpack the binaries tools/device/prebuild.sh built here (carry .carry/prebuilt; run in
#                    /tmp/ksrc after sync_src.sh) into build-cuda/, check they load against this machine's
#                    LibTorch, and mark the build done for `wait` (no build on the lease); $PREBUILT names
#                    another package of .carry/prebuilt (kakeya-cuda)
# A warm machine keeps /tmp/models and build-cuda/ between calls.
set -euo pipefail
M=/tmp/models
LOG=${LOG:-/tmp/kbuild.log}
mkdir -p $M
for step in "$@"; do
  case $step in
    recv)
      cp .carry/parts/gguf.part* .carry/parts/SHA256 $M/
      ls -la $M ;;
    build)
      TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
      setsid nohup bash -c "cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAKEYA_CUDA=ON \
          -DKAKEYA_TESTS=\${KAKEYA_TESTS:-ON} -DCMAKE_PREFIX_PATH=$TORCH_CMAKE && cmake --build build-cuda -j 16 \${KAKEYA_TARGETS:+--target \$KAKEYA_TARGETS}; echo BUILD_EXIT=\$?" \
          > $LOG 2>&1 < /dev/null &
      echo "build started" ;;
    wait)
      while ! grep -q BUILD_EXIT $LOG 2>/dev/null; do sleep 2; done
      tail -20 $LOG
      grep -q BUILD_EXIT=0 $LOG ;;
    model)
      if [ ! -f $M/gemma3-270m/kakeya_model.json ]; then
        cat $M/gguf.part* > $M/gemma-3-270m-q4_k_m.gguf
        echo "$(cat $M/SHA256)  $M/gemma-3-270m-q4_k_m.gguf" | sha256sum -c -
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl
        PYTHONPATH=/tmp/site python3 tools/fetch_model.py --gguf $M/gemma-3-270m-q4_k_m.gguf --out $M/gemma3-270m
      fi
      ls -la $M/gemma3-270m ;;
    prebuilt)
      P=.carry/prebuilt/${PREBUILT:-kakeya-cuda}.tgz
      [ -f $P ] || { echo "prebuilt: no $P here (carry .carry/prebuilt, made by tools/device/prebuild.sh)"; exit 1; }
      rm -rf build-cuda && tar -xzf $P
      want=$(awk '$1 == "torch" {print $2}' build-cuda/PREBUILT)
      lib=$(awk '$1 == "torch_lib" {print $2}' build-cuda/PREBUILT)
      have=$(python3 -c 'import torch;print(torch.__version__)')
      [ "$want" = "$have" ] || { echo "prebuilt: built against torch $want, this machine has $have: build here instead"; exit 1; }
      [ -d "$lib" ] || { echo "prebuilt: the binaries look for LibTorch in $lib, which this machine lacks: rebuild with DEVICE_TORCH_LIB"; exit 1; }
      for b in build-cuda/kakeya build-cuda/tests/*; do  # every binary the package holds
        if ldd $b | grep -q "not found"; then echo "prebuilt: $b misses libraries here:"; ldd $b | grep "not found"; exit 1; fi
      done
      build-cuda/kakeya --help > /dev/null
      echo "BUILD_EXIT=0 (prebuilt: $(head -1 build-cuda/PREBUILT))" > $LOG
      cat build-cuda/PREBUILT ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
