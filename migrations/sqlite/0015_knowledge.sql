-- smolchat store, schema version 15: knowledge (issue 53), collections of documents the chat
-- can search.
--
-- `knowledge_collections`: a user's collection (`owner`), shared with everyone (`shared` = 1)
-- or with chosen accounts (`knowledge_access`) by an admin. `knowledge_documents`: a document's
-- extracted text as it was added, and where its indexing stands: pending (waiting for the
-- indexer), indexing (chunked, its chunks being embedded; after a crash the indexer goes on
-- from the chunks not embedded yet), ready, or failed (`error` says why). `knowledge_chunks`:
-- the passages retrieval returns, in document order (`ord`), with the heading they fall under,
-- their byte range in the document's text, their token count and their embedding (little-endian
-- f32, NULL until embedded). Deleting a collection deletes its documents, and a document its
-- chunks (and so their vectors and keyword index rows).
CREATE TABLE knowledge_collections (
    id          TEXT    NOT NULL PRIMARY KEY,
    owner       TEXT    NOT NULL,
    name        TEXT    NOT NULL,
    description TEXT    NOT NULL DEFAULT '',
    shared      INTEGER NOT NULL DEFAULT 0 CHECK (shared IN (0, 1)),
    created_at  INTEGER NOT NULL
) STRICT;
CREATE INDEX knowledge_collections_owner ON knowledge_collections (owner);

CREATE TABLE knowledge_access (
    collection_id TEXT NOT NULL REFERENCES knowledge_collections (id) ON DELETE CASCADE,
    owner         TEXT NOT NULL,
    PRIMARY KEY (collection_id, owner)
) STRICT;
CREATE INDEX knowledge_access_owner ON knowledge_access (owner);

CREATE TABLE knowledge_documents (
    id            TEXT    NOT NULL PRIMARY KEY,
    collection_id TEXT    NOT NULL REFERENCES knowledge_collections (id) ON DELETE CASCADE,
    owner         TEXT    NOT NULL,
    name          TEXT    NOT NULL,
    kind          TEXT    NOT NULL,
    size_bytes    INTEGER NOT NULL,
    text          TEXT    NOT NULL,
    text_bytes    INTEGER NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('pending', 'indexing', 'ready', 'failed')),
    error         TEXT,
    chunks        INTEGER NOT NULL DEFAULT 0,
    embedded      INTEGER NOT NULL DEFAULT 0,
    created_at    INTEGER NOT NULL
) STRICT;
CREATE INDEX knowledge_documents_collection ON knowledge_documents (collection_id);
CREATE INDEX knowledge_documents_owner ON knowledge_documents (owner);
CREATE INDEX knowledge_documents_status ON knowledge_documents (status);

CREATE TABLE knowledge_chunks (
    id            INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    document_id   TEXT    NOT NULL REFERENCES knowledge_documents (id) ON DELETE CASCADE,
    collection_id TEXT    NOT NULL,
    ord           INTEGER NOT NULL CHECK (ord >= 0),
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    start_byte    INTEGER NOT NULL,
    end_byte      INTEGER NOT NULL,
    tokens        INTEGER NOT NULL,
    embedding     BLOB,
    UNIQUE (document_id, ord)
) STRICT;
CREATE INDEX knowledge_chunks_collection ON knowledge_chunks (collection_id);

-- Keyword search: FTS5 over each chunk's heading and text, words (unicode61, diacritics folded)
-- reduced to their stems (porter), ranked by bm25. The index holds no copy of the text; the
-- triggers keep it in step with the table.
CREATE VIRTUAL TABLE knowledge_chunks_fts USING fts5(
    heading,
    text,
    content = 'knowledge_chunks',
    content_rowid = 'id',
    tokenize = 'porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER knowledge_chunks_fts_insert AFTER INSERT ON knowledge_chunks BEGIN
    INSERT INTO knowledge_chunks_fts (rowid, heading, text) VALUES (new.id, new.heading, new.text);
END;
CREATE TRIGGER knowledge_chunks_fts_delete AFTER DELETE ON knowledge_chunks BEGIN
    INSERT INTO knowledge_chunks_fts (knowledge_chunks_fts, rowid, heading, text)
        VALUES ('delete', old.id, old.heading, old.text);
END;

-- The passages a user message was given (`settings.knowledge`), numbered as the model read them
-- ([1], [2], …), kept with the message so its citations still open after the document goes.
CREATE TABLE message_sources (
    message_id    TEXT    NOT NULL REFERENCES messages (id) ON DELETE CASCADE,
    n             INTEGER NOT NULL CHECK (n >= 1),
    collection_id TEXT    NOT NULL,
    document_id   TEXT    NOT NULL,
    document_name TEXT    NOT NULL,
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    PRIMARY KEY (message_id, n)
) STRICT;
