#!/usr/bin/env bash
# Re-fetches the vendored front-end libraries from the npm registry at their pinned versions
# (`npm pack` checks each tarball against the registry's integrity hash) and copies the files the
# server embeds into static/vendor (and axe-core, used only by the browser tests, into
# tests/vendor). The files are committed; run this only to change a version, then update the
# names in crates/web/src/pages.rs (STATIC_FILES), templates/base.html and the tests.
# static/vendor/SHA256SUMS lists what the server embeds; `sha256sum -c` checks it.
set -euo pipefail
KATEX=0.19.1
HLJS=11.12.0
AXE=4.14.1
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "katex@$KATEX" "@highlightjs/cdn-assets@$HLJS" "axe-core@$AXE" >/dev/null
for t in *.tgz; do mkdir -p "${t%.tgz}" && tar -xzf "$t" -C "${t%.tgz}"; done
v=$repo/static/vendor
rm -rf "$v/katex-"* "$v/highlight-"*
mkdir -p "$v/katex-$KATEX/fonts" "$repo/tests/vendor"
cp "katex-$KATEX/package/dist/katex.min.js" "katex-$KATEX/package/dist/katex.min.css" "$v/katex-$KATEX/"
# Browsers take the first format they support of each @font-face: woff2, so only those are served.
cp "katex-$KATEX/package/dist/fonts/"*.woff2 "$v/katex-$KATEX/fonts/"
cp "katex-$KATEX/package/LICENSE" "$v/katex-$KATEX/LICENSE"
cp "highlightjs-cdn-assets-$HLJS/package/highlight.min.js" "$v/highlight-$HLJS.min.js"
cp "highlightjs-cdn-assets-$HLJS/package/LICENSE" "$v/highlight-$HLJS.LICENSE"
cp "axe-core-$AXE/package/axe.min.js" "$repo/tests/vendor/axe-$AXE.min.js"
cd "$v" && find . -type f ! -name SHA256SUMS ! -name '*LICENSE*' | sort | xargs sha256sum >SHA256SUMS
echo "vendored katex $KATEX, highlight.js $HLJS (static/vendor), axe-core $AXE (tests/vendor)"
