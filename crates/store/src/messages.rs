//! Messages: a conversation's tree (every branch, and the one shown), the exchange of a user
//! message and its reply committed in one transaction, a reply's partial saves and its end.

use super::*;

/// Makes `leaf` the message a conversation shows (its branch ends there).
pub(super) async fn set_leaf(
    tx: &mut WriteTx,
    conversation: Uuid,
    leaf: Uuid,
) -> Result<(), StoreError> {
    sqlx::query("UPDATE conversations SET current_leaf = $1 WHERE id = $2")
        .bind(leaf.to_string())
        .bind(conversation.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The message a conversation shows, read inside a write transaction.
pub(super) async fn current_leaf(
    tx: &mut WriteTx,
    conversation: Uuid,
) -> Result<Option<Uuid>, StoreError> {
    let leaf: Option<Option<String>> =
        sqlx::query_scalar("SELECT current_leaf FROM conversations WHERE id = $1")
            .bind(conversation.to_string())
            .fetch_optional(&mut **tx)
            .await?;
    leaf.flatten()
        .map(|l| parse_uuid("conversations", &conversation.to_string(), &l))
        .transpose()
}

/// A message of `conversation` with `role`, read inside a write transaction: its parent.
/// `MessageNotFound` when there is none.
pub(super) async fn parent_of(
    tx: &mut WriteTx,
    conversation: Uuid,
    message: Uuid,
    role: Role,
) -> Result<Option<Uuid>, StoreError> {
    let row: Option<Option<String>> = sqlx::query_scalar(
        "SELECT parent_id FROM messages WHERE id = $1 AND conversation_id = $2 AND role = $3",
    )
    .bind(message.to_string())
    .bind(conversation.to_string())
    .bind(role.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    match row {
        None => Err(StoreError::MessageNotFound(message)),
        Some(parent) => parent
            .map(|p| parse_uuid("messages", &message.to_string(), &p))
            .transpose(),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn insert_message(
    tx: &mut WriteTx,
    conversation: Uuid,
    parent: Option<Uuid>,
    role: Role,
    content: &str,
    status: MessageStatus,
    created_at: i64,
    replica: Option<Uuid>,
) -> Result<MessageRow, StoreError> {
    let inserted: Result<MessageRow, sqlx::Error> = sqlx::query_as(concat!(
        "INSERT INTO messages (id, conversation_id, position, role, content, status, created_at, \
         replica_id, parent_id) \
         SELECT $1, $2, COALESCE(MAX(position), 0) + 1, $3, $4, $5, $6, $7, $8 \
         FROM messages WHERE conversation_id = $2 RETURNING ",
        message_columns!()
    ))
    .bind(Uuid::now_v7().to_string())
    .bind(conversation.to_string())
    .bind(role.as_str())
    .bind(content)
    .bind(status.as_str())
    .bind(created_at)
    .bind(
        (status == MessageStatus::Streaming)
            .then_some(replica)
            .flatten()
            .map(|r| r.to_string()),
    )
    .bind(parent.map(|p| p.to_string()))
    .fetch_one(&mut **tx)
    .await;
    match inserted {
        Ok(row) => {
            // The new message is what the conversation shows now.
            let id = parse_uuid("messages", &row.id, &row.id)?;
            set_leaf(tx, conversation, id).await?;
            Ok(row)
        }
        // `messages_one_streaming`: another reply of this conversation is streaming (on any
        // replica).
        Err(sqlx::Error::Database(e))
            if status == MessageStatus::Streaming && e.is_unique_violation() =>
        {
            Err(StoreError::ReplyInProgress(conversation))
        }
        Err(e) => Err(e.into()),
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct MessageRow {
    id: String,
    conversation_id: String,
    position: i64,
    role: String,
    content: String,
    reasoning: Option<String>,
    raw: Option<String>,
    status: String,
    error: Option<String>,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    cached_tokens: Option<i64>,
    timings: Option<String>,
    created_at: i64,
    imported: i64,
    parent_id: Option<String>,
}

impl MessageRow {
    fn into_message(self) -> Result<Message, StoreError> {
        const T: &str = "messages";
        let timings = self
            .timings
            .as_deref()
            .map(serde_json::from_str::<Timings>)
            .transpose()
            .map_err(|e| corrupt(T, &self.id, format!("bad timings JSON: {e}")))?;
        Ok(Message {
            id: parse_uuid(T, &self.id, &self.id)?,
            conversation_id: parse_uuid(T, &self.id, &self.conversation_id)?,
            position: self.position,
            role: self
                .role
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            status: self
                .status
                .parse()
                .map_err(|e: String| corrupt(T, &self.id, e))?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            content: self.content,
            reasoning: self.reasoning,
            raw: self.raw,
            error: self.error,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
            timings,
            imported: self.imported != 0,
            parent_id: self
                .parent_id
                .as_deref()
                .map(|p| parse_uuid(T, &self.id, p))
                .transpose()?,
        })
    }
}

/// The path from the root to `leaf` through `parent_id`s, in order (empty without a leaf).
pub fn path_to(all: &[Message], leaf: Option<Uuid>) -> Vec<Message> {
    let by_id: std::collections::HashMap<Uuid, &Message> = all.iter().map(|m| (m.id, m)).collect();
    let mut path = Vec::new();
    let mut at = leaf.and_then(|l| by_id.get(&l).copied());
    // Bounded by the number of messages, whatever the rows say.
    while let Some(m) = at.filter(|_| path.len() < all.len()) {
        path.push(m.clone());
        at = m.parent_id.and_then(|p| by_id.get(&p).copied());
    }
    path.reverse();
    path
}

/// How [`Store::insert_conversation`] stores one message: its id, whether it was imported, the
/// index of the message it follows (an earlier one; `None`: a first message), and whether it
/// is the leaf the conversation shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredRow {
    pub id: Uuid,
    pub imported: bool,
    pub parent: Option<usize>,
    pub current: bool,
}

impl StoredRow {
    /// `n` messages in one branch, each following the one before, new ids, the last shown.
    pub fn linear(n: usize, imported: impl Fn(usize) -> bool) -> Vec<StoredRow> {
        (0..n)
            .map(|i| StoredRow {
                id: Uuid::now_v7(),
                imported: imported(i),
                parent: i.checked_sub(1),
                current: i + 1 == n,
            })
            .collect()
    }
}

impl Store {
    /// Keeps the questions suggested after reply `message` (replacing any before).
    pub async fn set_follow_ups(
        &self,
        message: Uuid,
        questions: &[String],
    ) -> Result<(), StoreError> {
        let json = serde_json::to_string(questions)
            .map_err(|e| StoreError::InvalidSettings(format!("follow-ups: {e}")))?;
        sqlx::query(
            "INSERT INTO follow_ups (message_id, questions) VALUES ($1, $2) \
             ON CONFLICT (message_id) DO UPDATE SET questions = excluded.questions",
        )
        .bind(message.to_string())
        .bind(json)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The questions suggested after reply `message` (none when there are none).
    pub async fn follow_ups(&self, message: Uuid) -> Result<Vec<String>, StoreError> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT questions FROM follow_ups WHERE message_id = $1")
                .bind(message.to_string())
                .fetch_optional(&self.pool)
                .await?;
        match row {
            None => Ok(Vec::new()),
            Some((json,)) => serde_json::from_str(&json)
                .map_err(|e| corrupt("follow_ups", &message.to_string(), e.to_string())),
        }
    }

    /// The messages of a conversation in order (empty for an unknown conversation).
    pub async fn messages(&self, conversation: Uuid) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(concat!(
            "SELECT ",
            message_columns!(),
            " FROM messages WHERE conversation_id = $1 ORDER BY position"
        ))
        .bind(conversation.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(MessageRow::into_message).collect()
    }

    pub async fn get_message(&self, id: Uuid) -> Result<Option<Message>, StoreError> {
        let row: Option<MessageRow> = sqlx::query_as(concat!(
            "SELECT ",
            message_columns!(),
            " FROM messages WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(MessageRow::into_message).transpose()
    }

    /// Commits the user's message (durably, before returning) and bumps `updated_at`. When the
    /// conversation has no title yet, derives one from this message ([`derive_title`]).
    /// [`StoreError::ConversationNotFound`] when the conversation does not exist.
    pub async fn insert_user_message(
        &self,
        conversation: Uuid,
        content: &str,
    ) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, Some(content)).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let leaf = current_leaf(&mut tx, conversation).await?;
        let row = insert_message(
            &mut tx,
            conversation,
            leaf,
            Role::User,
            content,
            MessageStatus::Complete,
            now,
            None,
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// Inserts an assistant message with status `streaming` and empty content: the reply being
    /// generated. [`StoreError::ConversationNotFound`] when the conversation does not exist.
    pub async fn start_assistant_message(&self, conversation: Uuid) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, None).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let leaf = current_leaf(&mut tx, conversation).await?;
        let row = insert_message(
            &mut tx,
            conversation,
            leaf,
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// A new reply being generated for the user message `to` (regenerate): a sibling of the
    /// replies it has, which are kept. It becomes what the conversation shows.
    /// [`StoreError::MessageNotFound`] when `to` is not a user message of the conversation.
    pub async fn insert_reply(&self, conversation: Uuid, to: Uuid) -> Result<Message, StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, None).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        if let Err(e) = parent_of(&mut tx, conversation, to, Role::User).await {
            tx.rollback().await?;
            return Err(e);
        }
        let row = insert_message(
            &mut tx,
            conversation,
            Some(to),
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// The branch a conversation shows: the path from its first message to its current leaf,
    /// in order (every message of an older database, whose conversations are one branch).
    pub async fn branch(&self, conversation: Uuid) -> Result<Vec<Message>, StoreError> {
        Ok(self.messages_and_branch(conversation).await?.1)
    }

    /// Every message of a conversation (all branches, in insertion order) and the branch it
    /// shows ([`Store::branch`]), read once.
    pub async fn messages_and_branch(
        &self,
        conversation: Uuid,
    ) -> Result<(Vec<Message>, Vec<Message>), StoreError> {
        let all = self.messages(conversation).await?;
        let leaf: Option<Option<String>> =
            sqlx::query_scalar("SELECT current_leaf FROM conversations WHERE id = $1")
                .bind(conversation.to_string())
                .fetch_optional(&self.pool)
                .await?;
        let leaf = leaf
            .flatten()
            .and_then(|l| Uuid::parse_str(&l).ok())
            .or_else(|| all.last().map(|m| m.id));
        let branch = path_to(&all, leaf);
        Ok((all, branch))
    }

    /// Shows the branch through `message`: down to the newest message written after it (where
    /// the conversation was last continued from there, so switching back to a version returns
    /// to where one left it). Returns that leaf. [`StoreError::MessageNotFound`] when the
    /// message is not of the conversation.
    pub async fn select_branch(
        &self,
        conversation: Uuid,
        message: Uuid,
    ) -> Result<Uuid, StoreError> {
        let all = self.messages(conversation).await?;
        if !all.iter().any(|m| m.id == message) {
            return Err(StoreError::MessageNotFound(message));
        }
        // Messages come in insertion order, so a parent is always before its children: one
        // pass collects the subtree, and its last member is the newest (a leaf: anything after
        // it in the subtree would be its child, and newer).
        let mut subtree = std::collections::HashSet::from([message]);
        let mut leaf = message;
        for m in &all {
            if m.parent_id.is_some_and(|p| subtree.contains(&p)) {
                subtree.insert(m.id);
                leaf = m.id;
            }
        }
        let mut tx = WriteTx::begin(self).await?;
        set_leaf(&mut tx, conversation, leaf).await?;
        tx.commit().await?;
        Ok(leaf)
    }

    /// Stores a reply's final state (content, reasoning, raw text, status, error, token counts,
    /// timings) and bumps the conversation's `updated_at`. The status must not be `streaming`.
    /// [`StoreError::MessageNotFound`] when `id` is not an assistant message.
    pub async fn finish_assistant_message(
        &self,
        id: Uuid,
        reply: &FinishedReply,
    ) -> Result<Message, StoreError> {
        if reply.status == MessageStatus::Streaming {
            return Err(StoreError::InvalidStatus(reply.status.as_str()));
        }
        let timings = encode_json("timings", &reply.timings.sanitized())?;
        let mut tx = WriteTx::begin(self).await?;
        let row: Option<MessageRow> = sqlx::query_as(concat!(
            "UPDATE messages SET content = $1, reasoning = $2, raw = $3, status = $4, error = $5, \
             prompt_tokens = $6, completion_tokens = $7, cached_tokens = $8, timings = $9 \
             WHERE id = $10 AND role = 'assistant' RETURNING ",
            message_columns!()
        ))
        .bind(&reply.content)
        .bind(reply.reasoning.as_deref())
        .bind(&reply.raw)
        .bind(reply.status.as_str())
        .bind(reply.error.as_deref())
        .bind(reply.prompt_tokens)
        .bind(reply.completion_tokens)
        .bind(reply.cached_tokens)
        .bind(timings)
        .bind(id.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            return Err(StoreError::MessageNotFound(id));
        };
        sqlx::query("UPDATE conversations SET updated_at = $1 WHERE id = $2")
            .bind(now_micros())
            .bind(&row.conversation_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        row.into_message()
    }

    /// Stores one exchange in a single transaction: the user message and the assistant reply
    /// that starts `streaming` for it. It continues the branch shown, or with `editing` it is
    /// a new version of that user message (a sibling of it, which is kept: a new branch from
    /// the same point). A failure at any point changes nothing.
    /// [`StoreError::ConversationNotFound`] for an unknown conversation,
    /// [`StoreError::MessageNotFound`] when `editing` is not a user message of it.
    ///
    /// `attachments` gives the user message its prompt text and files (see [`Attachments`]); a
    /// file that is not a pending file of this conversation fails it all
    /// ([`StoreError::FileNotFound`]).
    pub async fn insert_exchange(
        &self,
        conversation: Uuid,
        content: &str,
        editing: Option<Uuid>,
        attachments: &Attachments,
    ) -> Result<(Message, Message), StoreError> {
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        if !touch(&mut tx, conversation, now, Some(content)).await? {
            tx.rollback().await?;
            return Err(StoreError::ConversationNotFound(conversation));
        }
        let parent = match editing {
            Some(from) => match parent_of(&mut tx, conversation, from, Role::User).await {
                Ok(p) => p,
                Err(e) => {
                    tx.rollback().await?;
                    return Err(e);
                }
            },
            None => current_leaf(&mut tx, conversation).await?,
        };
        let user = insert_message(
            &mut tx,
            conversation,
            parent,
            Role::User,
            content,
            MessageStatus::Complete,
            now,
            None,
        )
        .await?;
        let user_id = parse_uuid("messages", &user.id, &user.id)?;
        let user = if attachments.is_empty() {
            user
        } else {
            if let Err(e) = files::attach(&mut tx, conversation, user_id, attachments).await {
                tx.rollback().await?;
                return Err(e);
            }
            MessageRow {
                raw: attachments.raw.clone().or(user.raw),
                ..user
            }
        };
        let assistant = insert_message(
            &mut tx,
            conversation,
            Some(user_id),
            Role::Assistant,
            "",
            MessageStatus::Streaming,
            now,
            self.replica_id(),
        )
        .await?;
        tx.commit().await?;
        Ok((user.into_message()?, assistant.into_message()?))
    }

    /// Saves the text generated so far of a reply that is still `streaming`, so a crash keeps it
    /// (start-up marks it `interrupted` with this text). Returns whether a row was updated.
    pub async fn save_partial_reply(
        &self,
        id: Uuid,
        content: &str,
        reasoning: Option<&str>,
        raw: &str,
    ) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE messages SET content = $1, reasoning = $2, raw = $3 \
             WHERE id = $4 AND role = 'assistant' AND status = 'streaming'",
        )
        .bind(content)
        .bind(reasoning)
        .bind(raw)
        .bind(id.to_string())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(updated > 0)
    }
}
