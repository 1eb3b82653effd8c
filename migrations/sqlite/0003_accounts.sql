-- smolchat store, schema version 3: user accounts, their API keys, sign-up invites and /v1 usage.
--
-- Same conventions as 0001 (UUID TEXT ids, INTEGER microsecond timestamps, STRICT tables).
-- Secrets are never stored: passwords as argon2id PHC strings, API keys and invite codes only as
-- the lowercase hex SHA-256 of what the user holds, so a copy of the database yields no usable
-- credential.

CREATE TABLE users (
    -- UUIDv7; also the owner id of the account's conversations (`conversations.owner`) and the
    -- `subject` of its sessions (kind 'user').
    id            TEXT    NOT NULL PRIMARY KEY,
    -- Shown and typed at sign-in; unique without regard to ASCII case ('Alice' = 'alice').
    name          TEXT    NOT NULL UNIQUE COLLATE NOCASE
                  CHECK (length(name) BETWEEN 1 AND 64),
    -- argon2id PHC string ($argon2id$v=19$m=…,t=…,p=…$salt$hash).
    password_hash TEXT    NOT NULL CHECK (password_hash LIKE '$argon2id$%'),
    role          TEXT    NOT NULL DEFAULT 'user' CHECK (role IN ('user', 'admin')),
    -- Set while the account is disabled: its sessions and API keys stop working at once.
    disabled_at   INTEGER,
    created_at    INTEGER NOT NULL,
    -- Bumped (coarsely) by sign-in and session use; NULL until the first sign-in.
    last_seen_at  INTEGER
) STRICT;

CREATE TABLE api_keys (
    -- Lowercase hex SHA-256 of the key, never the key itself.
    id           TEXT    NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    user_id      TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name         TEXT    NOT NULL,
    -- The key's first characters, so its owner can tell keys apart in the list.
    prefix       TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER,
    revoked_at   INTEGER
) STRICT;

CREATE INDEX api_keys_user ON api_keys (user_id, created_at);

CREATE TABLE invites (
    -- Lowercase hex SHA-256 of the invite code.
    id         TEXT    NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    -- Single use: set (with the new account's id) by the sign-up that consumed it.
    used_at    INTEGER,
    used_by    TEXT    REFERENCES users (id) ON DELETE SET NULL
) STRICT;

-- Requests and tokens through /v1, per owner (an account id, or an opaque tag of a keyless
-- client), added when each request finishes.
CREATE TABLE api_usage (
    owner             TEXT    NOT NULL PRIMARY KEY,
    requests          INTEGER NOT NULL DEFAULT 0,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    last_at           INTEGER NOT NULL
) STRICT;
