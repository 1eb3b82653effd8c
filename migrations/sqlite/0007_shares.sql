-- smolchat store, schema version 7: read-only share links.
--
-- A share is a snapshot of the branch a conversation showed when it was shared (title and
-- messages as JSON), readable by anyone holding its link's token. The token is never stored:
-- `token_digest` is its SHA-256 (hex), so the database does not yield working links. Revoking keeps
-- the row (the owner sees it was revoked); deleting the conversation deletes its shares.
CREATE TABLE shares (
    id              TEXT    NOT NULL PRIMARY KEY,
    token_digest    TEXT    NOT NULL UNIQUE,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    owner           TEXT    NOT NULL,
    title           TEXT    NOT NULL,
    snapshot        TEXT    NOT NULL CHECK (json_valid(snapshot)),
    created_at      INTEGER NOT NULL,
    revoked_at      INTEGER
) STRICT;

CREATE INDEX shares_conversation ON shares (conversation_id);
