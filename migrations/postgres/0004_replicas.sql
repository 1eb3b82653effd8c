-- smolchat store on PostgreSQL, schema version 4: replicas (see migrations/sqlite/0004_replicas.sql).

CREATE TABLE replicas (
    id           TEXT   NOT NULL PRIMARY KEY,
    name         TEXT   NOT NULL CHECK (name <> ''),
    url          TEXT   NOT NULL DEFAULT '',
    started_at   BIGINT NOT NULL,
    heartbeat_at BIGINT NOT NULL,
    stopped_at   BIGINT,
    load         TEXT   NOT NULL DEFAULT '{}' CHECK (load::jsonb IS NOT NULL)
);

CREATE INDEX replicas_name ON replicas (name);

ALTER TABLE messages ADD COLUMN replica_id TEXT;

CREATE UNIQUE INDEX messages_one_streaming ON messages (conversation_id) WHERE status = 'streaming';
