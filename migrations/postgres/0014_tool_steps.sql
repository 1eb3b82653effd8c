-- smolchat store, schema version 14: the tool calls a reply made (issue 52).
--
-- `tool_steps`: one row per tool call of a reply, in the order made (`step` 0, 1, …). `status`:
-- awaiting_approval (the user has not allowed or denied it yet), running, done, error (the tool
-- failed, timed out, was stopped), denied (the user said no; the model read a refusal) or
-- interrupted (the server stopped while it ran: never re-run). `result`: what the model read.
-- `raw_offset` and `content_offset`: bytes of the reply's raw text and of its answer text when
-- the call was made, so the prompt and the page put the call and its result where they were.
-- Deleted with the reply.
CREATE TABLE tool_steps (
    message_id     TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    step           BIGINT NOT NULL CHECK (step >= 0),
    name           TEXT NOT NULL,
    arguments      TEXT NOT NULL,
    status         TEXT NOT NULL CHECK (status IN ('awaiting_approval', 'running', 'done', 'error', 'denied', 'interrupted')),
    result         TEXT,
    raw_offset     BIGINT NOT NULL CHECK (raw_offset >= 0),
    content_offset BIGINT NOT NULL CHECK (content_offset >= 0),
    duration_ms    DOUBLE PRECISION,
    PRIMARY KEY (message_id, step)
);
