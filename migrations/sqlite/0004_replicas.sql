-- smolchat store, schema version 4: replicas (several `smolchat serve` processes on one database).
--
-- Every server process registers a row at start (a new id each time) and refreshes
-- `heartbeat_at` every few seconds; a replica whose heartbeat is older than the lease
-- (`replica.lease_s`) is dead. Replies record the replica generating them, so start-up and the
-- periodic sweep mark `interrupted` only the replies of dead replicas, never one another live
-- replica is streaming. (SQLite serves one process; the table is the same so both backends keep
-- one schema.)

CREATE TABLE replicas (
    -- UUIDv7, new at every start of a server process.
    id           TEXT    NOT NULL PRIMARY KEY,
    -- `replica.name`: stable across restarts, so a restarted replica finds its earlier replies.
    name         TEXT    NOT NULL CHECK (name <> ''),
    -- Where the other replicas reach this one (`replica.url`); '' when it cannot be reached.
    url          TEXT    NOT NULL DEFAULT '',
    started_at   INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL,
    -- Set by a clean shutdown, and when a restart of the same name takes over.
    stopped_at   INTEGER,
    -- JSON of the replica's load at its last heartbeat (queue, running, KV use, warm caches).
    load         TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(load))
) STRICT;

CREATE INDEX replicas_name ON replicas (name);

-- The replica generating a `streaming` reply (NULL for rows written before this version).
ALTER TABLE messages ADD COLUMN replica_id TEXT;

-- At most one reply streams per conversation, whichever replica generates it. Rows from before
-- this version cannot break the rule: only the newest streaming reply of a conversation stays.
UPDATE messages SET status = 'interrupted',
       error = COALESCE(error, 'the server stopped before this reply was finished')
 WHERE status = 'streaming'
   AND id NOT IN (SELECT MAX(id) FROM messages WHERE status = 'streaming' GROUP BY conversation_id);
CREATE UNIQUE INDEX messages_one_streaming ON messages (conversation_id) WHERE status = 'streaming';

-- Name lookups ignore ASCII case on both backends through lower(name).
CREATE INDEX users_name_lower ON users (lower(name));
