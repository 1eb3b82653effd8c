-- smolchat store, schema version 12: what a deleted account leaves is its id, so nothing
-- written late can bring its rows back.
--
-- `deleted_users`: ids of accounts an administrator deleted (micros). A request of that account
-- that finishes after the delete (a `/v1` reply, a quota count) checks here and writes nothing.
-- Ids only: no name, no data of the person.
CREATE TABLE deleted_users (
    id         TEXT    NOT NULL PRIMARY KEY,
    deleted_at INTEGER NOT NULL
) STRICT;
