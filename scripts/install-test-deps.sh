#!/bin/sh
# Installs what the tests need from Debian: chromium and chromium-driver (the browser tests),
# postgresql (the store and replica tests run on it as well as on SQLite; scripts/test-postgres.sh
# starts a private server) and nginx (the load balancer in front of three replicas in
# tests/replicas.rs) and systemd (`systemd-analyze verify` of packaging/smolchat.service in
# tests/packaging.rs), and nodejs and npm when there is no `node` (the OpenID Connect provider in
# tests/oidc); then tests/oidc's and tests/mcp's npm packages (`npm ci`, pinned by their
# package-lock.json: the OpenID provider, the MCP servers) when they are missing. Idempotent: does nothing when all are present. Runs from any directory. The apt
# step needs root (CI runs as root) or sudo; under sudo, npm runs as the invoking user.
set -eu

REPO=$(CDPATH='' cd -- "$(dirname -- "$0")/.." && pwd)
OIDC_DIR="$REPO/tests/oidc"
# The MCP servers tests/mcp.rs starts (@modelcontextprotocol/server-everything and
# server-filesystem, pinned by tests/mcp/package-lock.json).
MCP_DIR="$REPO/tests/mcp"

have_postgres() {
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}

have_debian_tools() {
    [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && have_postgres && [ -x /usr/sbin/nginx ] \
        && command -v systemd-analyze >/dev/null 2>&1 && command -v node >/dev/null 2>&1
}

install_debian_tools() {
    packages="chromium chromium-driver postgresql nginx systemd"
    # Debian's node only when there is none: a node from elsewhere (nodesource, nvm) brings npm.
    if ! command -v node >/dev/null 2>&1; then
        packages="$packages nodejs npm"
    fi

    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            SUDO="sudo"
        else
            echo "install-test-deps: chromium, chromium-driver, postgresql, nginx, systemd or node is missing and this is not root (no sudo);" >&2
            echo "install them with: apt-get install $packages" >&2
            exit 1
        fi
    fi

    echo "install-test-deps: installing $packages with apt-get" >&2
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
    # shellcheck disable=SC2086 # $packages is a list of words
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y $packages || status=$?
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
    if ! command -v node >/dev/null 2>&1; then
        echo "install-test-deps: node is still missing after apt-get install" >&2
        exit 1
    fi
}

# `npm ci` in DIR (pinned by its package-lock.json). Under sudo, as the invoking user:
# node_modules in the checkout stays theirs.
npm_ci() {
    if [ "$(id -u)" -eq 0 ] && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ] \
        && command -v sudo >/dev/null 2>&1; then
        sudo -u "$SUDO_USER" -- npm ci --prefix "$1" --no-audit --no-fund
    else
        npm ci --prefix "$1" --no-audit --no-fund
    fi
}

install_oidc_packages() {
    if ! command -v npm >/dev/null 2>&1; then
        echo "install-test-deps: npm is missing; tests/oidc (the OpenID Connect provider) needs Node.js and npm;" >&2
        echo "install them with: apt-get install nodejs npm" >&2
        exit 1
    fi
    echo "install-test-deps: installing tests/oidc's npm packages with npm ci" >&2
    npm_ci "$OIDC_DIR"
    if [ ! -d "$OIDC_DIR/node_modules/oidc-provider" ]; then
        echo "install-test-deps: $OIDC_DIR/node_modules/oidc-provider is still missing after npm ci" >&2
        exit 1
    fi
}

if ! have_debian_tools; then
    install_debian_tools
fi

if [ ! -d "$OIDC_DIR/node_modules/oidc-provider" ]; then
    install_oidc_packages
fi

install_mcp_packages() {
    echo "install-test-deps: installing tests/mcp's npm packages (MCP servers) with npm ci" >&2
    npm_ci "$MCP_DIR"
    for pkg in server-everything server-filesystem; do
        if [ ! -d "$MCP_DIR/node_modules/@modelcontextprotocol/$pkg" ]; then
            echo "install-test-deps: $MCP_DIR/node_modules/@modelcontextprotocol/$pkg is still missing after npm ci" >&2
            exit 1
        fi
    done
}

if [ ! -d "$MCP_DIR/node_modules/@modelcontextprotocol/server-filesystem" ] \
    || [ ! -d "$MCP_DIR/node_modules/@modelcontextprotocol/server-everything" ]; then
    install_mcp_packages
fi
