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

PORT="${SMOLTEST_PG_PORT:-54329}"
DIR="${SMOLTEST_PG_DIR:-${TMPDIR:-/tmp}/smolchat-pg-$(id -u)-$PORT}"
URL="postgres://postgres@127.0.0.1:$PORT/postgres"

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

case "${1:-}" in
start)
    if [ -f "$DIR/data/PG_VERSION" ] && as_owner "$bindir/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1; then
        echo "$URL"
        exit 0
    fi
    mkdir -p "$DIR"
    if [ "$(id -u)" -eq 0 ]; then
        if ! id postgres >/dev/null 2>&1; then
            echo "test-postgres: running as root but there is no postgres user to run the server as" >&2
            exit 1
        fi
        chown postgres "$DIR"
    fi
    chmod 700 "$DIR"
    if [ ! -f "$DIR/data/PG_VERSION" ]; then
        as_owner "$bindir/initdb" -D "$DIR/data" -U postgres --auth=trust --encoding=UTF8 \
            --locale=C >"$DIR/initdb.log" 2>&1 || {
            echo "test-postgres: initdb failed; see $DIR/initdb.log" >&2
            cat "$DIR/initdb.log" >&2
            exit 1
        }
    fi
    as_owner "$bindir/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -c port=$PORT -c unix_socket_directories=$DIR -c fsync=off -c max_connections=300" \
        start >/dev/null || {
        echo "test-postgres: the server did not start; see $DIR/server.log" >&2
        tail -20 "$DIR/server.log" >&2 || true
        exit 1
    }
    echo "$URL"
    ;;
stop)
    if [ -f "$DIR/data/PG_VERSION" ]; then
        as_owner "$bindir/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
    ;;
*)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
