-- smolchat store, schema version 13: what an account prefers.
--
-- `user_preferences`: one row per account that set something. `default_model`: the model its new
-- conversations start on (a model id; one the server no longer serves is ignored). Deleted with
-- the account.
CREATE TABLE user_preferences (
    user_id       TEXT NOT NULL PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
    default_model TEXT
) STRICT;
