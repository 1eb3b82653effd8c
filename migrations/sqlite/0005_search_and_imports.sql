-- smolchat store, schema version 5: an index for conversation search, and imported messages
-- marked as such.
--
-- Search finds conversations whose messages contain a piece of text, ignoring case. Without an
-- index that is a scan of every message an owner has (a few searches over a large imported
-- history held the pool's connections for seconds). FTS5's trigram tokenizer indexes every
-- three-character window of the text, so a substring of three or more characters is found
-- through the index with the same meaning as before (a substring, not a word); shorter search
-- text matches titles only. The index holds no copy of the text (`content='messages'`): the
-- triggers below keep it in step with the table.
CREATE VIRTUAL TABLE messages_fts USING fts5(
    content,
    content = 'messages',
    content_rowid = 'rowid',
    tokenize = 'trigram case_sensitive 0'
);
INSERT INTO messages_fts (messages_fts) VALUES ('rebuild');

CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
    INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content);
END;

-- 1 for a message that came in through an import: its text is whoever wrote the file, not this
-- server's model, so an assistant message of it is kept out of the control tokens like user
-- text when the conversation is rendered (only replies generated here go in unguarded).
ALTER TABLE messages ADD COLUMN imported INTEGER NOT NULL DEFAULT 0 CHECK (imported IN (0, 1));
