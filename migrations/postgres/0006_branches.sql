-- smolchat store, schema version 6 (PostgreSQL): messages form a tree, so regenerating or editing keeps what
-- it replaces.
--
-- `parent_id` is the message a message follows (NULL for a conversation's first messages).
-- Siblings (messages with one parent) are the versions: replies regenerated for one user
-- message, or user messages edited from one point. `current_leaf` is the message the
-- conversation shows: the branch is the path from the root to it, and the next message
-- continues it. `position` stays the insertion order within the conversation (it orders
-- siblings, oldest first).
ALTER TABLE messages ADD COLUMN parent_id TEXT;
ALTER TABLE conversations ADD COLUMN current_leaf TEXT;

-- Every existing conversation is one branch: each message follows the one before it.
UPDATE messages SET parent_id = (
    SELECT p.id FROM messages p
    WHERE p.conversation_id = messages.conversation_id AND p.position < messages.position
    ORDER BY p.position DESC LIMIT 1
);
UPDATE conversations SET current_leaf = (
    SELECT m.id FROM messages m WHERE m.conversation_id = conversations.id
    ORDER BY m.position DESC LIMIT 1
);

CREATE INDEX messages_parent ON messages (conversation_id, parent_id);
