-- smolchat store, schema version 13: what an account prefers.
--
-- `user_preferences`: one row per account that set something. `default_model`: the model its new
-- conversations start on (a model id; one the server no longer serves is ignored). Deleted with
-- the account.
CREATE TABLE user_preferences (
    user_id       TEXT NOT NULL PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
    default_model TEXT
) STRICT;

-- `follow_ups`: the questions the task model suggests after a reply (a JSON array of strings),
-- shown under the last reply. Deleted with the reply.
CREATE TABLE follow_ups (
    message_id TEXT NOT NULL PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
    questions  TEXT NOT NULL CHECK (json_valid(questions))
) STRICT;
