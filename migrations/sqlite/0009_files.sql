-- smolchat store, schema version 9: files in conversations.
--
-- A file's text as the model reads it (extracted from a PDF, decoded from UTF-8), with its name,
-- kind and size for the chips the pages show. Uploaded into a conversation it waits
-- (`message_id` NULL) until a user message takes it; the message's `raw` then holds the prompt
-- text with the files placed in it. Deleting the conversation or the message deletes its files.
CREATE TABLE files (
    id              TEXT    NOT NULL PRIMARY KEY,
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    message_id      TEXT    REFERENCES messages (id) ON DELETE CASCADE,
    owner           TEXT    NOT NULL,
    name            TEXT    NOT NULL,
    kind            TEXT    NOT NULL,
    media_type      TEXT    NOT NULL,
    size_bytes      INTEGER NOT NULL,
    text            TEXT    NOT NULL,
    tokens          INTEGER NOT NULL,
    created_at      INTEGER NOT NULL
) STRICT;

CREATE INDEX files_conversation ON files (conversation_id);
CREATE INDEX files_message ON files (message_id);
CREATE INDEX files_owner ON files (owner);
