-- smolchat store on PostgreSQL, schema version 2: server-side sessions (see
-- migrations/sqlite/0002_sessions.sql for what each column means).

CREATE TABLE sessions (
    id           TEXT   NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    kind         TEXT   NOT NULL CHECK (kind <> ''),
    subject      TEXT   NOT NULL CHECK (subject <> ''),
    fingerprint  TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    last_seen_at BIGINT NOT NULL,
    revoked_at   BIGINT
);

CREATE INDEX sessions_subject ON sessions (kind, subject);
CREATE INDEX sessions_expires ON sessions (expires_at);
