#!/bin/sh
# Installs what the tests need from Debian: chromium and chromium-driver (the browser tests),
# postgresql (the store and replica tests run on it as well as on SQLite; scripts/test-postgres.sh
# starts a private server) and nginx (the load balancer in front of three replicas in
# tests/replicas.rs) and systemd (`systemd-analyze verify` of packaging/smolchat.service in
# tests/packaging.rs). Idempotent: does nothing when all are present. Needs root (CI runs as root)
# or sudo.
set -eu

have_postgres() {
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && have_postgres && [ -x /usr/sbin/nginx ] \
    && command -v systemd-analyze >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-test-deps: chromium, chromium-driver, postgresql, nginx or systemd is missing and this is not root (no sudo);" >&2
        echo "install them with: apt-get install chromium chromium-driver postgresql nginx systemd" >&2
        exit 1
    fi
fi

echo "install-test-deps: installing chromium, chromium-driver, postgresql, nginx and systemd with apt-get" >&2
$SUDO apt-get update
# policy-rc.d refuses service starts: the packages' own servers (PostgreSQL's main cluster on
# 5432, nginx on 80) are not wanted; the tests start private ones.
made_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    made_policy=1
fi
status=0
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y chromium chromium-driver postgresql nginx systemd || status=$?
if [ -n "$made_policy" ]; then
    $SUDO rm -f /usr/sbin/policy-rc.d
fi
[ "$status" -eq 0 ] || exit "$status"

if ! have_postgres; then
    echo "install-test-deps: PostgreSQL's initdb is still missing after apt-get install" >&2
    exit 1
fi
for tool in /usr/bin/chromium /usr/bin/chromedriver /usr/sbin/nginx /usr/bin/systemd-analyze; do
    if [ ! -x "$tool" ]; then
        echo "install-test-deps: $tool is still missing after apt-get install" >&2
        exit 1
    fi
done
