//! Stored `/v1/responses`: each is a conversation of its caller's, saved when the reply ends and
//! read back by `previous_response_id`.

use super::*;

impl Conversations {
    /// An id for a response to be stored: a conversation id this replica owns (so the chat
    /// that continues it warms the cache where it goes).
    pub fn new_response_id(&self) -> Uuid {
        self.cluster().new_conversation_id()
    }

    /// Whether the caller may keep one more stored response (a conversation each): the number
    /// of conversations one owner may keep (`limits.max_conversations_per_user`). Asked before
    /// the reply is generated, so a refusal costs no compute. (The per-minute creation rate is
    /// not applied: a program's requests are already paced by the scheduler's per-user limits.)
    pub async fn check_response_room(&self, caller: &Caller) -> Result<()> {
        let max = self.cfg.max_conversations_per_user;
        if max > 0 {
            let n = self.store.count_conversations(&caller.owner).await?;
            if n >= 0 && n as u64 >= max {
                return Err(ConversationError::UserLimit {
                    message: format!(
                        "you keep {n} conversations and stored responses, the most one user may                          ({max}); delete some, or send `\"store\": false`"
                    ),
                    retry_after_s: 60,
                });
            }
        }
        Ok(())
    }

    /// Stores a response as the caller's conversation `id`: `messages` in order (earlier turns,
    /// the request's input, the reply last), each with its id and whether the client wrote it
    /// (`true`, guarded in prompts like user text) or the model did. Refused past the caller's
    /// stored-text quota. Named after its first user message.
    pub async fn save_response(
        &self,
        caller: &Caller,
        id: Uuid,
        messages: &[ImportedMessage],
        rows: &[StoredRow],
    ) -> Result<Conversation> {
        let bytes: u64 = messages
            .iter()
            .flat_map(|m| [Some(&m.content), m.reasoning.as_ref(), m.raw.as_ref()])
            .flatten()
            .map(|t| t.len() as u64)
            .sum();
        let max = self.cfg.max_stored_bytes_per_user;
        if max > 0 {
            let stored = self.store.stored_text_bytes(&caller.owner).await?;
            if stored.saturating_add(bytes) > max {
                return Err(ConversationError::TooLarge(format!(
                    "you keep {} MiB of conversations and this response adds {} MiB; the limit \
                     is {} MiB per user (limits.max_stored_mib_per_user): delete some, or send \
                     `\"store\": false`",
                    mib(stored),
                    mib(bytes),
                    mib(max)
                )));
            }
        }
        let title = messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| smolchat_store::derive_title(&m.content))
            .unwrap_or_default();
        let c = self
            .store
            .insert_conversation(
                id,
                &caller.owner,
                &title,
                &self.default_settings(),
                messages,
                rows,
            )
            .await?;
        tracing::info!(conversation = %c.id, owner = %caller.owner, messages = messages.len(), "response stored");
        Ok(c)
    }

    /// A stored response of the caller: its conversation's messages, the reply last.
    /// `NotFound` when there is none, it is another owner's, or its conversation no longer
    /// ends with a reply (it was continued in the chat).
    pub async fn response(
        &self,
        caller: &Caller,
        id: Uuid,
    ) -> Result<(Conversation, Vec<Message>)> {
        let c = self.owned(caller, id).await?;
        let messages = self.store.branch(id).await?;
        match messages.last() {
            Some(m) if m.role == Role::Assistant => Ok((c, messages)),
            _ => Err(ConversationError::NotFound),
        }
    }
}
