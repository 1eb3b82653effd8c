-- smolchat store, schema version 13: what an account prefers (see the SQLite migration).
CREATE TABLE user_preferences (
    user_id       TEXT NOT NULL PRIMARY KEY REFERENCES users(id) ON DELETE CASCADE,
    default_model TEXT
);
