-- smolchat store, schema version 8 (PostgreSQL): organising conversations, and system-prompt presets.
--
-- Each owner's folders (a conversation is in at most one; deleting a folder leaves its
-- conversations outside any), pinned and archived flags, and free-form tags. Presets are a named
-- system prompt: an owner's own, or shared with everyone (owner NULL, made by an admin).
CREATE TABLE folders (
    id         TEXT    NOT NULL PRIMARY KEY,
    owner      TEXT    NOT NULL,
    name       TEXT    NOT NULL,
    created_at BIGINT NOT NULL,
    UNIQUE (owner, name)
);

ALTER TABLE conversations ADD COLUMN pinned BIGINT NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1));
ALTER TABLE conversations ADD COLUMN archived BIGINT NOT NULL DEFAULT 0 CHECK (archived IN (0, 1));
ALTER TABLE conversations ADD COLUMN folder_id TEXT REFERENCES folders (id) ON DELETE SET NULL;
CREATE INDEX conversations_folder ON conversations (folder_id);

CREATE TABLE conversation_tags (
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    tag             TEXT NOT NULL,
    PRIMARY KEY (conversation_id, tag)
);
CREATE INDEX conversation_tags_tag ON conversation_tags (tag);

CREATE TABLE presets (
    id            TEXT    NOT NULL PRIMARY KEY,
    owner         TEXT,
    name          TEXT    NOT NULL,
    system_prompt TEXT    NOT NULL,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
CREATE UNIQUE INDEX presets_owner_name ON presets (COALESCE(owner, ''), name);
