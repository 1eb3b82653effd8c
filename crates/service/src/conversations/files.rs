//! Files in a conversation, for its owner: upload (checked, read and counted off the event
//! loop), list, remove a file not yet sent, and send a message carrying files. What is accepted
//! and how a file reads in the prompt is [`crate::files`].

use uuid::Uuid;

use super::{invalid, mib, Accepted, ConversationError, Conversations, Result};
use crate::caller::Caller;
use crate::documents::ReadError;
use crate::files::{self, FileError, FileText};
use crate::session::{DraftOutcome, SendMessage, WarmDraft};
use smolchat_store::{Document, FileRecord, NewFile};

/// What became of an uploaded file.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Uploaded {
    /// Waiting for the next message, whole.
    Attached(FileRecord),
    /// Too long to read whole: searched for each message, in the conversation's collection.
    Searched {
        message: String,
        collection: Uuid,
        collection_name: String,
        document: Document,
    },
}

/// Tokens kept free of a file, for the question about it and the reply: a file that leaves
/// less than this in the context window is refused at upload.
const ROOM_FOR_THE_REST: usize = 256;

impl From<ReadError> for ConversationError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::File(e) => e.into(),
            ReadError::Busy {
                message,
                retry_after_s,
            } => ConversationError::UserLimit {
                message,
                retry_after_s,
            },
            ReadError::DoesNotFit { .. } => ConversationError::ContextOverflow(e.to_string()),
            ReadError::Unavailable(m) => ConversationError::Unavailable(m),
        }
    }
}

impl From<FileError> for ConversationError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::TooLarge { .. } => ConversationError::TooLarge(e.to_string()),
            other => invalid("file", other.to_string()),
        }
    }
}

impl Conversations {
    /// Stores a file for the caller's conversation `id`, waiting for the next message: checked
    /// (type, size, the owner's quota), its text extracted and counted in tokens against the
    /// context window.
    pub async fn upload_file(
        &self,
        caller: &Caller,
        id: Uuid,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<FileRecord> {
        let c = self.owned(caller, id).await?;
        let limit = self.cfg.max_file_bytes;
        let size = bytes.len();
        if size > limit {
            return Err(FileError::TooLarge {
                name: files::check_name(name).unwrap_or_else(|_| name.to_string()),
                size,
                limit,
            }
            .into());
        }
        let quota = self.cfg.max_file_bytes_per_user;
        if quota > 0 {
            let kept = self.store.stored_file_bytes(&caller.owner).await?;
            if kept.saturating_add(size as u64) > quota {
                return Err(ConversationError::TooLarge(format!(
                    "you keep {} MiB of attached files and this one adds {} MiB; the limit is {} \
                     MiB per user (limits.max_file_mib_per_user): delete conversations with \
                     files first",
                    mib(kept),
                    mib(size as u64),
                    mib(quota)
                )));
            }
        }
        let name = files::check_name(name)?;
        let room = self.context_window.saturating_sub(ROOM_FOR_THE_REST);
        let too_long = |tokens: String| {
            ConversationError::ContextOverflow(format!(
                "{name:?} is {tokens} tokens of text; the model's context window is {} tokens, \
                 and a file may take at most {room} of them (the rest is for your question and \
                 the reply): attach a shorter part of it",
                self.context_window
            ))
        };
        let extracted = match self
            .documents
            .read(&caller.owner, &name, bytes, limit, room)
            .await
        {
            Ok(extracted) => extracted,
            Err(ReadError::DoesNotFit { at_least }) => {
                return Err(too_long(format!("at least {at_least}")))
            }
            Err(e) => return Err(e.into()),
        };
        let block = files::file_block(FileText {
            name: &name,
            kind: extracted.kind.as_str(),
            text: &extracted.text,
        });
        // Counting tokens is CPU work: off the event loop, and stopped as soon as the count
        // passes the room (a long file is refused without being tokenized whole).
        let tokenizer = std::sync::Arc::clone(&self.tokenizer);
        let longest = self.documents.longest_token_bytes();
        let counted = tokio::task::spawn_blocking(move || {
            files::count_tokens_within(&tokenizer, &block, room, longest)
        })
        .await
        .map_err(|e| {
            ConversationError::Internal(format!("counting the file's tokens failed: {e}"))
        })?
        .map_err(|e| ConversationError::Internal(format!("tokenizer: {e}")))?;
        let tokens = match counted {
            files::TokenCount::Within(n) => n + 2,
            files::TokenCount::Over { at_least } => {
                return Err(too_long(format!("at least {at_least}")))
            }
        };
        if tokens > room {
            return Err(too_long(tokens.to_string()));
        }
        let file = self
            .store
            .create_file(
                c.id,
                &caller.owner,
                &NewFile {
                    name: &name,
                    kind: extracted.kind.as_str(),
                    media_type: extracted.media_type,
                    size_bytes: size as i64,
                    text: &extracted.text,
                    tokens: tokens as i64,
                },
            )
            .await?;
        tracing::info!(conversation = %c.id, file = %file.id, kind = file.kind, bytes = size, tokens, "file attached");
        Ok(file)
    }

    /// [`Conversations::upload_file`], and for an account a file too long to read whole: it goes
    /// into the conversation's own knowledge collection (made the first time, and chosen in
    /// its settings) and is searched for each message instead; what happened says so.
    pub async fn upload_or_search(
        &self,
        caller: &Caller,
        id: Uuid,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<Uploaded> {
        // Kept only where a search could take the file instead.
        let kept = (!caller.guest).then(|| bytes.clone());
        let why = match self.upload_file(caller, id, name, bytes).await {
            Ok(file) => return Ok(Uploaded::Attached(file)),
            Err(ConversationError::ContextOverflow(why)) if kept.is_some() => why,
            Err(e) => return Err(e),
        };
        let bytes = kept.unwrap_or_default();
        let c = self.owned(caller, id).await?;
        let knowledge = &self.sessions.shared().knowledge;
        let collection = knowledge.files_collection(caller, &c.id, &c.title).await?;
        let document = knowledge
            .add_document(caller, collection.id, name, bytes)
            .await?;
        if !c.settings.knowledge.contains(&collection.id) {
            let mut settings = c.settings.clone();
            settings.knowledge.push(collection.id);
            self.store.update_settings(c.id, &settings).await?;
        }
        tracing::info!(conversation = %c.id, document = %document.id, "a file too long to read whole is searched instead");
        Ok(Uploaded::Searched {
            message: format!(
                "{:?} is too long to read whole ({}): it is searched for each message instead, \
                 in the collection {:?}",
                document.name,
                why.split(';').next().unwrap_or(&why).trim(),
                collection.name
            ),
            collection: collection.id,
            collection_name: collection.name,
            document,
        })
    }

    /// The files of the caller's conversation `id`: those its messages carry and those waiting
    /// for the next message (`message_id` null).
    pub async fn files(&self, caller: &Caller, id: Uuid) -> Result<Vec<FileRecord>> {
        let c = self.owned(caller, id).await?;
        Ok(self.store.files_of(c.id).await?)
    }

    /// Removes a file waiting in the caller's conversation `id` (a sent message keeps its files).
    pub async fn remove_file(&self, caller: &Caller, id: Uuid, file: Uuid) -> Result<()> {
        let c = self.owned(caller, id).await?;
        if self.store.delete_pending_file(c.id, file).await? {
            Ok(())
        } else {
            Err(ConversationError::NoSuch(format!(
                "no file {file} is waiting in this conversation (files a sent message carries \
                 stay with it)"
            )))
        }
    }

    /// The files a message carries: each once, at most `limits.max_files_per_message`.
    fn message_files(&self, mut file_ids: Vec<Uuid>) -> Result<Vec<Uuid>> {
        let mut seen = std::collections::HashSet::new();
        file_ids.retain(|f| seen.insert(*f));
        let max = self.cfg.max_files_per_message;
        if file_ids.len() > max {
            return Err(invalid(
                "files",
                format!(
                    "a message may carry at most {max} files (limits.max_files_per_message), got {}",
                    file_ids.len()
                ),
            ));
        }
        Ok(file_ids)
    }

    /// Warms the message being typed in the caller's conversation `id` (its text so far and the
    /// waiting files it will carry): the prompt it would make is computed into the
    /// conversation's KV cache in spare steps, so its send computes only what changed (see
    /// `smolchat_serving::warm`). Best effort: skipped, saying why, when a reply is running,
    /// warming is off or nothing is new.
    pub async fn warm_draft(
        &self,
        caller: &Caller,
        id: Uuid,
        content: String,
        file_ids: Vec<Uuid>,
    ) -> Result<DraftOutcome> {
        let c = self.owned(caller, id).await?;
        let file_ids = self.message_files(file_ids)?;
        let session = self.sessions.get_or_start(c.id);
        let outcome = session
            .send(WarmDraft {
                content,
                files: file_ids,
            })
            .await??;
        tracing::debug!(conversation = %c.id, ?outcome, "a typed draft");
        Ok(outcome)
    }

    /// Sends a message carrying `files` (waiting files of this conversation, at most
    /// `limits.max_files_per_message`).
    pub async fn send_with_files(
        &self,
        caller: &Caller,
        id: Uuid,
        content: String,
        file_ids: Vec<Uuid>,
    ) -> Result<Accepted> {
        let c = self.owned(caller, id).await?;
        let file_ids = self.message_files(file_ids)?;
        let mut msg = SendMessage::new(content);
        msg.files = file_ids;
        let accepted = self.send_to(caller, c.id, msg).await?;
        tracing::debug!(conversation = %c.id, message = %accepted.user_message.id, "message accepted");
        Ok(accepted)
    }
}
