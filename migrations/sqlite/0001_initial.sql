-- smolchat store, schema version 1.
--
-- Conventions (the Rust side in src/store/ relies on them):
-- * ids are UUIDv7 stored as lowercase hyphenated TEXT, so they read well in the sqlite3 shell and
--   sort in creation order;
-- * timestamps are INTEGER microseconds since the Unix epoch, UTC: they compare and sort as numbers
--   and need no date parsing in SQL;
-- * JSON columns (settings, timings) hold serde_json documents written by the store;
-- * STRICT tables, so a wrong type is an error instead of a silently coerced value.

CREATE TABLE conversations (
    id          TEXT    NOT NULL PRIMARY KEY,
    owner       TEXT    NOT NULL,
    -- '' means "no title yet": the first user message then names the conversation.
    title       TEXT    NOT NULL DEFAULT '',
    settings    TEXT    NOT NULL CHECK (json_valid(settings)),
    created_at  INTEGER NOT NULL,
    -- Bumped by every message write; the conversation lists sort on it.
    updated_at  INTEGER NOT NULL
) STRICT;

-- A user's list (owner = ? ORDER BY updated_at DESC) and the admin list (ORDER BY updated_at DESC).
CREATE INDEX conversations_owner_updated ON conversations (owner, updated_at DESC);
CREATE INDEX conversations_updated ON conversations (updated_at DESC);

CREATE TABLE messages (
    id                TEXT    NOT NULL PRIMARY KEY,
    conversation_id   TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    -- Per-conversation sequence number (1, 2, ...): message order never depends on clock resolution.
    position          INTEGER NOT NULL,
    role              TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    -- The answer text (for assistant messages without the reasoning).
    content           TEXT    NOT NULL DEFAULT '',
    reasoning         TEXT,
    -- The exact generated text: the template re-inserts it verbatim so the KV cache stays reusable.
    raw               TEXT,
    status            TEXT    NOT NULL
                      CHECK (status IN ('complete', 'streaming', 'stopped', 'interrupted', 'error')),
    error             TEXT,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    cached_tokens     INTEGER,
    timings           TEXT    CHECK (timings IS NULL OR json_valid(timings)),
    created_at        INTEGER NOT NULL,
    -- Also serves "messages of a conversation in order" and the ON DELETE CASCADE lookup.
    UNIQUE (conversation_id, position)
) STRICT;

-- Start-up recovery looks for replies left mid-stream; a partial index keeps that lookup tiny.
CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
