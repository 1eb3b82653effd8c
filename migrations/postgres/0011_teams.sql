-- smolchat store on PostgreSQL, schema version 11: OpenID Connect identities, forced password
-- changes, shared usage counters (see migrations/sqlite/0011_teams.sql for what each column
-- means).

CREATE TABLE user_identities (
    issuer     TEXT   NOT NULL,
    subject    TEXT   NOT NULL,
    user_id    TEXT   NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (issuer, subject)
);

CREATE INDEX user_identities_user ON user_identities (user_id);

ALTER TABLE users ADD COLUMN password_reset_at BIGINT;

CREATE TABLE usage_counters (
    subject TEXT   NOT NULL,
    period  TEXT   NOT NULL CHECK (period IN ('minute', 'day', 'month')),
    start   BIGINT NOT NULL,
    tokens  BIGINT NOT NULL DEFAULT 0,
    events  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, period, start)
);

CREATE INDEX usage_counters_start ON usage_counters (start);
