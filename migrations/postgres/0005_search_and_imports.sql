-- smolchat store, schema version 5 (PostgreSQL): an index for conversation search, and imported
-- messages marked as such. See the SQLite file of the same version for why.
--
-- pg_trgm's GIN index serves `ILIKE '%text%'` for text of three or more characters, the same
-- substring meaning as SQLite's trigram FTS5 index. pg_trgm ships with PostgreSQL (contrib) and
-- is a trusted extension: a role that may create objects in the database may install it.
CREATE EXTENSION IF NOT EXISTS pg_trgm;
CREATE INDEX messages_content_trgm ON messages USING gin (content gin_trgm_ops);

ALTER TABLE messages ADD COLUMN imported BIGINT NOT NULL DEFAULT 0 CHECK (imported IN (0, 1));
