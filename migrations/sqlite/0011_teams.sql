-- smolchat store, schema version 11: running smolchat for a team.
--
-- `user_identities`: an account's sign-ins at an OpenID Connect provider, linked by the
-- provider's (issuer, subject) pair, which never changes for a person (their name or e-mail
-- may). Made on the first sign-in; removed with the account.
CREATE TABLE user_identities (
    issuer     TEXT    NOT NULL,
    subject    TEXT    NOT NULL,
    user_id    TEXT    NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (issuer, subject)
) STRICT;

CREATE INDEX user_identities_user ON user_identities (user_id);

-- Set when an administrator resets the password: the next sign-in must choose a new one before
-- anything else (micros; NULL: no change asked for).
ALTER TABLE users ADD COLUMN password_reset_at INTEGER;

-- Counters every replica adds to and reads, so N replicas on one database enforce one limit:
-- `subject` is who is counted (`user:ID`, `key:ID`, `guest:ID`, `address:IP`, `login:…`),
-- `period` the window (`minute`, `day`, `month`), `start` the window's first second (Unix,
-- UTC). Rows of windows long past are removed by the daily trim.
CREATE TABLE usage_counters (
    subject TEXT    NOT NULL,
    period  TEXT    NOT NULL CHECK (period IN ('minute', 'day', 'month')),
    start   INTEGER NOT NULL,
    tokens  INTEGER NOT NULL DEFAULT 0,
    events  INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, period, start)
) STRICT;

CREATE INDEX usage_counters_start ON usage_counters (start);
