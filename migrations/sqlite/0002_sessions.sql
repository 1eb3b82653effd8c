-- smolchat store, schema version 2: server-side sessions.
--
-- A session is what a sign-in cookie stands for. The cookie carries a random 32-byte token; the
-- table keeps only its SHA-256 (`id`), so a copy of the database (a backup, a leaked file) holds
-- no usable cookie. Admin sessions use kind 'admin' today; user accounts reuse the table with
-- kind 'user' and the user's id as `subject`.
--
-- A session is valid while `revoked_at IS NULL`, `expires_at` is in the future, and its
-- `fingerprint` equals the current fingerprint of the credential it was made under (for admin
-- sessions a keyed hash of `server.admin_token`), so changing that credential ends every session
-- made under the old one without touching the rows.

CREATE TABLE sessions (
    -- Lowercase hex SHA-256 of the cookie token, never the token itself.
    id           TEXT    NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    -- What signed in: 'admin' (the admin token), later 'user' (an account).
    kind         TEXT    NOT NULL CHECK (kind <> ''),
    -- Who, within the kind: 'admin' for the admin token, a user id for accounts.
    subject      TEXT    NOT NULL CHECK (subject <> ''),
    -- Of the credential at sign-in; compared on every use.
    fingerprint  TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    -- Absolute: using a session does not extend it.
    expires_at   INTEGER NOT NULL,
    -- Bumped (coarsely) when the session is used; shown on the admin page later.
    last_seen_at INTEGER NOT NULL,
    -- Set by sign-out and "revoke every session of this subject".
    revoked_at   INTEGER
) STRICT;

-- "Revoke every session of this subject" and "sessions of this user".
CREATE INDEX sessions_subject ON sessions (kind, subject);
-- Purging expired sessions.
CREATE INDEX sessions_expires ON sessions (expires_at);
