-- smolchat store, schema version 13: what an account prefers (see the SQLite migration).
CREATE TABLE user_preferences (
    user_id       TEXT NOT NULL PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
    default_model TEXT
);

-- `follow_ups`: the task model's suggested questions after a reply (a JSON array of strings).
CREATE TABLE follow_ups (
    message_id TEXT NOT NULL PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
    questions  TEXT NOT NULL CHECK (questions::jsonb IS NOT NULL)
);
