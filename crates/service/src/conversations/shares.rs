//! Share links: a read-only snapshot of a conversation's shown branch behind a random token
//! (the store keeps its hash), listed and revoked by the owner, read by anyone with the link.

use super::*;

/// A new share link: the record and the token of its URL (`/s/{token}`), shown once.
#[derive(Debug, Clone, Serialize)]
pub struct NewShare {
    pub share: ShareRecord,
    pub token: String,
}

/// One message of a share's snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedMessage {
    pub role: Role,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// A reply's tool calls, each with its result (in the snapshot as they were).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_steps: Vec<smolchat_store::ToolStep>,
}

/// What a share link shows.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedConversation {
    pub title: String,
    pub created_at: DateTime<Utc>,
    pub messages: Vec<SharedMessage>,
}

impl Conversations {
    /// Shares the branch the caller's conversation shows: a snapshot (later messages are not
    /// in it), readable at `/s/{token}` by anyone with the link until revoked. The token is in
    /// the answer only; the store keeps its SHA-256.
    pub async fn share(&self, caller: &Caller, id: Uuid) -> Result<NewShare> {
        let c = self.owned(caller, id).await?;
        if self.replying(c.id).await {
            return Err(ConversationError::Busy(
                "a reply is being generated; share once it is done".into(),
            ));
        }
        let mut steps = self.store.tool_steps_of(c.id).await?;
        let messages: Vec<SharedMessage> = self
            .store
            .branch(c.id)
            .await?
            .into_iter()
            .filter(|m| matches!(m.role, Role::User | Role::Assistant))
            .map(|m| SharedMessage {
                role: m.role,
                tool_steps: steps.remove(&m.id).unwrap_or_default(),
                content: m.content,
                reasoning: m.reasoning.filter(|r| !r.is_empty()),
            })
            .collect();
        if messages.is_empty() {
            return Err(invalid(
                "conversation",
                "the conversation has no messages yet: there is nothing to share",
            ));
        }
        let snapshot = serde_json::to_string(&messages)
            .map_err(|e| ConversationError::Internal(format!("share snapshot: {e}")))?;
        let (token, digest) = smolchat_auth::secret::new_session();
        let title = if c.title.is_empty() {
            "Untitled conversation".to_string()
        } else {
            c.title.clone()
        };
        let share = self
            .store
            .create_share(c.id, &caller.owner, &digest, &title, &snapshot)
            .await?;
        tracing::info!(conversation = %c.id, share = %share.id, "conversation shared");
        Ok(NewShare { share, token })
    }

    /// The caller's conversation's share links, newest first (revoked ones included).
    pub async fn shares(&self, caller: &Caller, id: Uuid) -> Result<Vec<ShareRecord>> {
        let c = self.owned(caller, id).await?;
        Ok(self.store.shares_of(c.id).await?)
    }

    /// Revokes a share link of the caller's conversation: its page answers 404 from now on.
    pub async fn revoke_share(&self, caller: &Caller, id: Uuid, share: Uuid) -> Result<()> {
        let c = self.owned(caller, id).await?;
        if self.store.revoke_share(c.id, share).await? {
            tracing::info!(conversation = %c.id, %share, "share revoked");
            Ok(())
        } else {
            Err(ConversationError::NoSuch(format!(
                "share {share} is not a live share of this conversation"
            )))
        }
    }

    /// What a share link shows, for anyone holding it. `NotFound` for a token that is not a
    /// live share (never made, revoked, or its conversation deleted), however it is shaped.
    pub async fn shared(&self, token: &str) -> Result<SharedConversation> {
        let Some(digest) = smolchat_auth::secret::session_id(token) else {
            return Err(ConversationError::NotFound);
        };
        let share = self
            .store
            .live_share(&digest)
            .await?
            .ok_or(ConversationError::NotFound)?;
        let messages: Vec<SharedMessage> = serde_json::from_str(&share.snapshot)
            .map_err(|e| ConversationError::Internal(format!("share {}: {e}", share.id)))?;
        Ok(SharedConversation {
            title: share.title,
            created_at: share.created_at,
            messages,
        })
    }
}
