#!/bin/sh
# Checks, before `make test` starts, that this process may mount a small tmpfs: the storage-fault
# tests (tests/faults.rs) need it, and under `make test` (SMOLTEST_REQUIRE_MOUNT=1) they fail
# rather than skip without it. Failing here says why at once instead of after the build.
set -eu
dir="$(mktemp -d "${TMPDIR:-/tmp}/smolchat-mount-check.XXXXXX")"
if mount -t tmpfs -o size=1m tmpfs "$dir" 2>"$dir.err"; then
    umount "$dir"
    rmdir "$dir"
    rm -f "$dir.err"
    exit 0
fi
echo "check-mount: cannot mount a tmpfs ($(cat "$dir.err")); the storage-fault tests need it." >&2
echo "check-mount: run make test as root (as CI does), or run 'cargo test' without SMOLTEST_REQUIRE_MOUNT to skip them." >&2
rm -f "$dir.err"
rmdir "$dir"
exit 1
