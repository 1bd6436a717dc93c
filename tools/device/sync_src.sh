#!/usr/bin/env bash
# Run on the GPU machine from the synced working tree: mirror it into $SRC (default /tmp/ksrc)
# by content, so a warm machine's build there only recompiles what changed. (Each device call
# re-sends the working tree; copying by mtime would rebuild everything, and a build inside the
# synced tree would race with the next sync.) Also brings .carry/include (header-only deps)
# when the call carried it.
set -euo pipefail
SRC=${SRC:-/tmp/ksrc}
mkdir -p "$SRC"
n=0
while IFS= read -r -d '' f; do
  f=${f#./}
  if ! cmp -s "$f" "$SRC/$f"; then
    mkdir -p "$SRC/$(dirname "$f")"
    cp "$f" "$SRC/$f"
    n=$((n + 1))
  fi
done < <(find . \( -path './build*' -o -path './.carry/parts/*' -o -path './.carry/whl/*' -o -path './.git/*' \
              -o -path './checkpoints/models/*' -o -path './.venv' -o -path '*/__pycache__' \) -prune -o -type f -print0)
echo "[sync] $n files changed in $SRC"
