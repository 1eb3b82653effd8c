-- smolchat store, schema version 10: the audit log.
--
-- Who did what, to what, from where and when: sign-ins and their failures, sign-outs, password
-- and role changes, keys, invites, admin actions, imports, exports and deletions. Rows are only
-- added, and removed after `audit.keep_days`. `id` is a UUID v7, so it orders rows by time too.
CREATE TABLE audit_log (
    id      TEXT    NOT NULL PRIMARY KEY,
    at      INTEGER NOT NULL,
    actor   TEXT    NOT NULL,
    action  TEXT    NOT NULL,
    target  TEXT    NOT NULL,
    address TEXT    NOT NULL,
    detail  TEXT    NOT NULL
) STRICT;

CREATE INDEX audit_log_at ON audit_log (at);
CREATE INDEX audit_log_actor ON audit_log (actor);
CREATE INDEX audit_log_action ON audit_log (action);
