#!/bin/sh
# Installs what the browser tests (tests/browser.rs) need: Debian's chromium and chromium-driver.
# Idempotent: does nothing when both are present. Needs root (CI runs as root) or sudo.
set -eu

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-test-deps: chromium and chromium-driver are missing and this is not root (no sudo);" >&2
        echo "install them with: apt-get install chromium chromium-driver" >&2
        exit 1
    fi
fi

echo "install-test-deps: installing chromium and chromium-driver with apt-get" >&2
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y chromium chromium-driver

for tool in /usr/bin/chromium /usr/bin/chromedriver; do
    if [ ! -x "$tool" ]; then
        echo "install-test-deps: $tool is still missing after apt-get install" >&2
        exit 1
    fi
done
