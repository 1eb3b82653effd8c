#!/bin/sh
# A private PostgreSQL server for the test suite: its own data directory and port, trust
# authentication on 127.0.0.1 only, started and stopped by `make test` (and started on demand by
# the tests themselves when SMOLTEST_DATABASE_URL is unset).
#
#   scripts/test-postgres.sh start   # prints the server's URL (starts it when it is not running)
#   scripts/test-postgres.sh stop
#
# Uses Debian's `postgresql` package (scripts/install-test-deps.sh installs it). As root the server
# runs as the `postgres` user, which PostgreSQL insists on. fsync is off: the suite tests what
# smolchat commits, not the disk, and each test makes its own database.
set -eu

# The first port tried; when another program holds it, the next ones are tried in turn (each
# port has its own data directory, so a later `start` finds the server that runs).
FIRST_PORT="${SMOLTEST_PG_PORT:-54329}"
PORTS=10
dir_of() { echo "${SMOLTEST_PG_DIR:-${TMPDIR:-/tmp}/smolchat-pg-$(id -u)}-$1"; }
url_of() { echo "postgres://postgres@127.0.0.1:$1/postgres"; }

bindir=""
for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then bindir="$d"; break; fi
done
if [ -z "$bindir" ]; then
    echo "test-postgres: PostgreSQL's server programs are not installed (apt-get install postgresql, or run scripts/install-test-deps.sh)" >&2
    exit 1
fi

as_owner() {
    if [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

running_on() {
    d="$(dir_of "$1")"
    [ -f "$d/data/PG_VERSION" ] && as_owner "$bindir/pg_ctl" -D "$d/data" status >/dev/null 2>&1
}

# Starts a server on port $1: 0 when it runs, 2 when the port is someone else's, 1 otherwise.
start_on() {
    PORT="$1"
    DIR="$(dir_of "$PORT")"
    mkdir -p "$DIR"
    if [ "$(id -u)" -eq 0 ]; then
        if ! id postgres >/dev/null 2>&1; then
            echo "test-postgres: running as root but there is no postgres user to run the server as" >&2
            return 1
        fi
        chown postgres "$DIR"
    fi
    chmod 700 "$DIR"
    if [ ! -f "$DIR/data/PG_VERSION" ]; then
        as_owner "$bindir/initdb" -D "$DIR/data" -U postgres --auth=trust --encoding=UTF8 \
            --locale=C >"$DIR/initdb.log" 2>&1 || {
            echo "test-postgres: initdb failed; see $DIR/initdb.log" >&2
            cat "$DIR/initdb.log" >&2
            return 1
        }
    fi
    : >"$DIR/server.log"
    chown postgres "$DIR/server.log" 2>/dev/null || true
    if as_owner "$bindir/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -c port=$PORT -c unix_socket_directories=$DIR -c fsync=off -c max_connections=300" \
        start >/dev/null; then
        return 0
    fi
    if grep -q "already in use" "$DIR/server.log" 2>/dev/null; then
        return 2
    fi
    echo "test-postgres: the server did not start; see $DIR/server.log" >&2
    tail -20 "$DIR/server.log" >&2 || true
    return 1
}

case "${1:-}" in
start)
    i=0
    while [ "$i" -lt "$PORTS" ]; do
        if running_on $((FIRST_PORT + i)); then
            url_of $((FIRST_PORT + i))
            exit 0
        fi
        i=$((i + 1))
    done
    i=0
    while [ "$i" -lt "$PORTS" ]; do
        port=$((FIRST_PORT + i))
        rc=0
        start_on "$port" || rc=$?
        case "$rc" in
        0)
            url_of "$port"
            exit 0
            ;;
        2) echo "test-postgres: port $port is taken by another program; trying the next" >&2 ;;
        *) exit 1 ;;
        esac
        i=$((i + 1))
    done
    echo "test-postgres: ports $FIRST_PORT to $((FIRST_PORT + PORTS - 1)) are all taken" >&2
    exit 1
    ;;
stop)
    i=0
    while [ "$i" -lt "$PORTS" ]; do
        d="$(dir_of $((FIRST_PORT + i)))"
        if [ -f "$d/data/PG_VERSION" ]; then
            as_owner "$bindir/pg_ctl" -D "$d/data" -m fast -w stop >/dev/null 2>&1 || true
        fi
        i=$((i + 1))
    done
    ;;
*)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
