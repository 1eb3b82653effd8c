-- smolchat store on PostgreSQL, schema version 1 (the same tables as migrations/sqlite/0001).
--
-- Conventions shared with the SQLite schema, which the Rust side in src/store/ relies on:
-- ids are UUIDv7 as lowercase hyphenated TEXT; timestamps are BIGINT microseconds since the Unix
-- epoch (UTC); JSON columns are TEXT written by the store (checked to parse as JSON).

CREATE TABLE conversations (
    id          TEXT   NOT NULL PRIMARY KEY,
    owner       TEXT   NOT NULL,
    title       TEXT   NOT NULL DEFAULT '',
    settings    TEXT   NOT NULL CHECK (settings::jsonb IS NOT NULL),
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);

CREATE INDEX conversations_owner_updated ON conversations (owner, updated_at DESC);
CREATE INDEX conversations_updated ON conversations (updated_at DESC);

CREATE TABLE messages (
    id                TEXT   NOT NULL PRIMARY KEY,
    conversation_id   TEXT   NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    position          BIGINT NOT NULL,
    role              TEXT   NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content           TEXT   NOT NULL DEFAULT '',
    reasoning         TEXT,
    raw               TEXT,
    status            TEXT   NOT NULL
                      CHECK (status IN ('complete', 'streaming', 'stopped', 'interrupted', 'error')),
    error             TEXT,
    prompt_tokens     BIGINT,
    completion_tokens BIGINT,
    cached_tokens     BIGINT,
    timings           TEXT   CHECK (timings IS NULL OR timings::jsonb IS NOT NULL),
    created_at        BIGINT NOT NULL,
    UNIQUE (conversation_id, position)
);

CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
