-- smolchat store, schema version 15 (PostgreSQL): knowledge (issue 53), collections of
-- documents the chat can search. See the SQLite file of the same version for the tables.
--
-- Keyword search is PostgreSQL's full text search: an `english` tsvector of each chunk's heading
-- and text, kept by the database (a generated column) and indexed with GIN, ranked by
-- ts_rank_cd. Vectors are kept as little-endian f32 bytes and scanned exactly by the service
-- (pgvector is not in the package registries this project installs from).
CREATE TABLE knowledge_collections (
    id          TEXT    NOT NULL PRIMARY KEY,
    owner       TEXT    NOT NULL,
    name        TEXT    NOT NULL,
    description TEXT    NOT NULL DEFAULT '',
    shared      BIGINT  NOT NULL DEFAULT 0 CHECK (shared IN (0, 1)),
    created_at  BIGINT  NOT NULL
);
CREATE INDEX knowledge_collections_owner ON knowledge_collections (owner);

CREATE TABLE knowledge_access (
    collection_id TEXT NOT NULL REFERENCES knowledge_collections (id) ON DELETE CASCADE,
    owner         TEXT NOT NULL,
    PRIMARY KEY (collection_id, owner)
);
CREATE INDEX knowledge_access_owner ON knowledge_access (owner);

CREATE TABLE knowledge_documents (
    id            TEXT    NOT NULL PRIMARY KEY,
    collection_id TEXT    NOT NULL REFERENCES knowledge_collections (id) ON DELETE CASCADE,
    owner         TEXT    NOT NULL,
    name          TEXT    NOT NULL,
    kind          TEXT    NOT NULL,
    size_bytes    BIGINT  NOT NULL,
    text          TEXT    NOT NULL,
    text_bytes    BIGINT  NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('pending', 'indexing', 'ready', 'failed')),
    error         TEXT,
    chunks        BIGINT  NOT NULL DEFAULT 0,
    embedded      BIGINT  NOT NULL DEFAULT 0,
    created_at    BIGINT  NOT NULL
);
CREATE INDEX knowledge_documents_collection ON knowledge_documents (collection_id);
CREATE INDEX knowledge_documents_owner ON knowledge_documents (owner);
CREATE INDEX knowledge_documents_status ON knowledge_documents (status);

CREATE TABLE knowledge_chunks (
    id            BIGSERIAL NOT NULL PRIMARY KEY,
    document_id   TEXT    NOT NULL REFERENCES knowledge_documents (id) ON DELETE CASCADE,
    collection_id TEXT    NOT NULL,
    ord           BIGINT  NOT NULL CHECK (ord >= 0),
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    start_byte    BIGINT  NOT NULL,
    end_byte      BIGINT  NOT NULL,
    tokens        BIGINT  NOT NULL,
    embedding     BYTEA,
    words         tsvector GENERATED ALWAYS AS (to_tsvector('english', heading || ' ' || text)) STORED,
    UNIQUE (document_id, ord)
);
CREATE INDEX knowledge_chunks_collection ON knowledge_chunks (collection_id);
CREATE INDEX knowledge_chunks_words ON knowledge_chunks USING gin (words);

-- The passages a user message was given (`settings.knowledge`), numbered as the model read them
-- ([1], [2], …), kept with the message so its citations still open after the document goes.
CREATE TABLE message_sources (
    message_id    TEXT    NOT NULL REFERENCES messages (id) ON DELETE CASCADE,
    n             BIGINT NOT NULL CHECK (n >= 1),
    collection_id TEXT    NOT NULL,
    document_id   TEXT    NOT NULL,
    document_name TEXT    NOT NULL,
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    PRIMARY KEY (message_id, n)
);
