-- smolchat store on PostgreSQL, schema version 3: accounts, API keys, invites, /v1 usage (see
-- migrations/sqlite/0003_accounts.sql for what each column means).

CREATE TABLE users (
    id            TEXT   NOT NULL PRIMARY KEY,
    -- Unique without regard to ASCII case through the index below ('Alice' = 'alice'), like
    -- SQLite's COLLATE NOCASE.
    name          TEXT   NOT NULL CHECK (length(name) BETWEEN 1 AND 64),
    password_hash TEXT   NOT NULL CHECK (password_hash LIKE '$argon2id$%'),
    role          TEXT   NOT NULL DEFAULT 'user' CHECK (role IN ('user', 'admin')),
    disabled_at   BIGINT,
    created_at    BIGINT NOT NULL,
    last_seen_at  BIGINT
);

CREATE UNIQUE INDEX users_name_nocase ON users (lower(name));

CREATE TABLE api_keys (
    id           TEXT   NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    user_id      TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name         TEXT   NOT NULL,
    prefix       TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    last_used_at BIGINT,
    revoked_at   BIGINT
);

CREATE INDEX api_keys_user ON api_keys (user_id, created_at);

CREATE TABLE invites (
    id         TEXT   NOT NULL PRIMARY KEY CHECK (length(id) = 64),
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at    BIGINT,
    used_by    TEXT   REFERENCES users (id) ON DELETE SET NULL
);

CREATE TABLE api_usage (
    owner             TEXT   NOT NULL PRIMARY KEY,
    requests          BIGINT NOT NULL DEFAULT 0,
    prompt_tokens     BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    last_at           BIGINT NOT NULL
);
