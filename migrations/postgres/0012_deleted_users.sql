-- smolchat store on PostgreSQL, schema version 12: ids of deleted accounts (see
-- migrations/sqlite/0012_deleted_users.sql).

CREATE TABLE deleted_users (
    id         TEXT   NOT NULL PRIMARY KEY,
    deleted_at BIGINT NOT NULL
);
