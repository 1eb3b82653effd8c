-- smolchat store, schema version 8: organising conversations, and system-prompt presets.
--
-- Each owner's folders (a conversation is in at most one; deleting a folder leaves its
-- conversations outside any), pinned and archived flags, and free-form tags. Presets are a named
-- system prompt: an owner's own, or shared with everyone (owner NULL, made by an admin).
CREATE TABLE folders (
    id         TEXT    NOT NULL PRIMARY KEY,
    owner      TEXT    NOT NULL,
    name       TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (owner, name)
) STRICT;

ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1));
ALTER TABLE conversations ADD COLUMN archived INTEGER NOT NULL DEFAULT 0 CHECK (archived IN (0, 1));
ALTER TABLE conversations ADD COLUMN folder_id TEXT REFERENCES folders (id) ON DELETE SET NULL;
CREATE INDEX conversations_folder ON conversations (folder_id);

CREATE TABLE conversation_tags (
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    tag             TEXT NOT NULL,
    PRIMARY KEY (conversation_id, tag)
) STRICT;
CREATE INDEX conversation_tags_tag ON conversation_tags (tag);

CREATE TABLE presets (
    id            TEXT    NOT NULL PRIMARY KEY,
    owner         TEXT,
    name          TEXT    NOT NULL,
    system_prompt TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
) STRICT;
CREATE UNIQUE INDEX presets_owner_name ON presets (COALESCE(owner, ''), name);
