//! Conversations: created, read, listed (keyset pages, search), imported whole, renamed, their
//! settings changed, deleted; the rows they are read from.

use super::*;

/// The `(updated_at, id)` bind values of a cursor (both NULL for the first page).
pub(super) fn cursor_binds(cursor: Option<&Cursor>) -> (Option<i64>, Option<String>) {
    match cursor {
        Some(c) => (Some(c.updated_at_micros), Some(c.id.to_string())),
        None => (None, None),
    }
}

/// Rows of a page query fetched with `limit + 1`: the first `limit`, and the next page's cursor
/// when the extra row shows there is more.
pub(super) fn into_page(rows: Vec<SummaryRow>, limit: usize) -> Result<ListPage, StoreError> {
    let more = rows.len() > limit;
    let items: Vec<ConversationSummary> = rows
        .into_iter()
        .take(limit)
        .map(SummaryRow::into_summary)
        .collect::<Result<_, _>>()?;
    let next = if more {
        items.last().map(|c| Cursor {
            updated_at_micros: c.updated_at.timestamp_micros(),
            id: c.id,
        })
    } else {
        None
    };
    Ok(ListPage { items, next })
}

#[derive(sqlx::FromRow)]
pub(super) struct ConversationRow {
    id: String,
    owner: String,
    title: String,
    settings: String,
    created_at: i64,
    updated_at: i64,
}

impl ConversationRow {
    fn into_conversation(self) -> Result<Conversation, StoreError> {
        const T: &str = "conversations";
        let settings = serde_json::from_str(&self.settings)
            .map_err(|e| corrupt(T, &self.id, format!("bad settings JSON: {e}")))?;
        Ok(Conversation {
            id: parse_uuid(T, &self.id, &self.id)?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            updated_at: parse_time(T, &self.id, self.updated_at)?,
            owner: self.owner,
            title: self.title,
            settings,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct SummaryRow {
    id: String,
    owner: String,
    title: String,
    message_count: i64,
    created_at: i64,
    updated_at: i64,
    pinned: i64,
    archived: i64,
    folder_id: Option<String>,
}

impl SummaryRow {
    fn into_summary(self) -> Result<ConversationSummary, StoreError> {
        const T: &str = "conversations";
        Ok(ConversationSummary {
            id: parse_uuid(T, &self.id, &self.id)?,
            created_at: parse_time(T, &self.id, self.created_at)?,
            updated_at: parse_time(T, &self.id, self.updated_at)?,
            folder_id: self
                .folder_id
                .map(|f| parse_uuid(T, &self.id, &f))
                .transpose()?,
            pinned: self.pinned != 0,
            archived: self.archived != 0,
            owner: self.owner,
            title: self.title,
            message_count: self.message_count,
        })
    }
}

impl Store {
    pub async fn create_conversation(
        &self,
        owner: &str,
        settings: &ConversationSettings,
    ) -> Result<Conversation, StoreError> {
        self.create_conversation_with_id(Uuid::now_v7(), owner, settings)
            .await
    }

    /// [`Store::create_conversation`] under a given new id (a UUIDv7 the caller picked, e.g. one
    /// the replica router sends to this replica).
    pub async fn create_conversation_with_id(
        &self,
        id: Uuid,
        owner: &str,
        settings: &ConversationSettings,
    ) -> Result<Conversation, StoreError> {
        settings.validate().map_err(StoreError::InvalidSettings)?;
        let settings_json = encode_json("settings", settings)?;
        let now = now_micros();
        let row: ConversationRow = sqlx::query_as(concat!(
            "INSERT INTO conversations (id, owner, title, settings, created_at, updated_at) \
             VALUES ($1, $2, '', $3, $4, $4) RETURNING ",
            conversation_columns!()
        ))
        .bind(id.to_string())
        .bind(owner)
        .bind(settings_json)
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        let conversation = row.into_conversation()?;
        tracing::debug!(conversation = %conversation.id, owner, "conversation created");
        Ok(conversation)
    }

    pub async fn get_conversation(&self, id: Uuid) -> Result<Option<Conversation>, StoreError> {
        let row: Option<ConversationRow> = sqlx::query_as(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations WHERE id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.map(ConversationRow::into_conversation).transpose()
    }

    /// All of `owner`'s conversations, most recently active first, page after page of
    /// [`Store::list_conversations_page`] (tools and tests; the web layer shows one page).
    pub async fn list_conversations(
        &self,
        owner: &str,
        search: Option<&str>,
    ) -> Result<Vec<ConversationSummary>, StoreError> {
        let filter = ListFilter {
            search: search.map(str::to_string),
            ..ListFilter::default()
        };
        let mut all = Vec::new();
        let mut page = PageRequest {
            limit: MAX_PAGE,
            before: None,
        };
        loop {
            let got = self.list_conversations_page(owner, &filter, &page).await?;
            all.extend(got.items);
            match got.next {
                Some(next) => page.before = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// One page of `owner`'s conversations, most recently active first: at most `page.limit`
    /// of them after `page.before` (keyset pagination on `(updated_at, id)`, so a page never
    /// repeats or skips a conversation however many are added meanwhile), with the cursor of
    /// the next page when there is one. `search` keeps those whose title or any message contains
    /// it, ignoring case; a blank `search` is no filter. The needle is plain text: `%`, `_` and
    /// quotes match themselves.
    ///
    /// Messages are searched through the trigram index of migration 0005 (SQLite FTS5, pg_trgm),
    /// which finds substrings of [`SEARCH_INDEX_MIN_CHARS`] or more characters; shorter search
    /// text matches titles only, since it would need a scan of every message.
    ///
    /// The rest of `filter` keeps archived or unarchived, pinned or unpinned conversations, those
    /// in one folder, or those with one tag.
    pub async fn list_conversations_page(
        &self,
        owner: &str,
        filter: &ListFilter,
        page: &PageRequest,
    ) -> Result<ListPage, StoreError> {
        let search = filter
            .search
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty());
        let limit = page.limit.clamp(1, MAX_PAGE);
        let (before_at, before_id) = cursor_binds(page.before.as_ref());
        // The message half of the search, bound as $6: an FTS5 phrase (SQLite) or an ILIKE
        // pattern (PostgreSQL); NULL when the needle is too short for the index.
        let indexed = search.filter(|s| s.chars().count() >= SEARCH_INDEX_MIN_CHARS);
        let message_needle = indexed.map(|s| match self.backend {
            Backend::Sqlite => format!("\"{}\"", s.replace('"', "\"\"")),
            Backend::Postgres => format!("%{}%", like_escape(s)),
        });
        macro_rules! page_query {
            ($find:literal, $messages:literal) => {
                concat!(
                    "SELECT ",
                    summary_columns!(),
                    " FROM conversations c WHERE c.owner = $1 AND ($2 IS NULL \
                       OR ",
                    $find,
                    "(lower(c.title), lower($2)) > 0 \
                       OR ($6 IS NOT NULL AND c.id IN (",
                    $messages,
                    "))) \
                       AND ($3 IS NULL OR c.updated_at < $3 OR (c.updated_at = $3 AND c.id < $4)) \
                       AND ($7 IS NULL OR c.archived = $7) AND ($8 IS NULL OR c.pinned = $8) \
                       AND ($9 IS NULL OR c.folder_id = $9) \
                       AND ($10 IS NULL OR EXISTS (SELECT 1 FROM conversation_tags t \
                            WHERE t.conversation_id = c.id AND t.tag = $10)) \
                     ORDER BY c.updated_at DESC, c.id DESC LIMIT $5"
                )
            };
        }
        let query = match self.backend {
            Backend::Sqlite => page_query!(
                "instr",
                "SELECT m.conversation_id FROM messages m WHERE m.rowid IN \
                 (SELECT rowid FROM messages_fts WHERE messages_fts MATCH $6)"
            ),
            Backend::Postgres => page_query!(
                "strpos",
                "SELECT m.conversation_id FROM messages m WHERE m.content ILIKE $6"
            ),
        };
        let rows: Vec<SummaryRow> = sqlx::query_as(query)
            .bind(owner)
            .bind(search)
            .bind(before_at)
            .bind(before_id)
            .bind((limit + 1) as i64)
            .bind(message_needle)
            .bind(filter.archived.map(i64::from))
            .bind(filter.pinned.map(i64::from))
            .bind(filter.folder.map(|f| f.to_string()))
            .bind(filter.tag.as_deref())
            .fetch_all(&self.pool)
            .await?;
        into_page(rows, limit)
    }

    /// One page of every owner's conversations, most recently active first (the admin page);
    /// keyset pagination as in [`Store::list_conversations_page`].
    pub async fn list_all_conversations_page(
        &self,
        page: &PageRequest,
    ) -> Result<ListPage, StoreError> {
        let limit = page.limit.clamp(1, MAX_PAGE);
        let (before_at, before_id) = cursor_binds(page.before.as_ref());
        let rows: Vec<SummaryRow> = sqlx::query_as(concat!(
            "SELECT ",
            summary_columns!(),
            " FROM conversations c \
             WHERE ($1 IS NULL OR c.updated_at < $1 OR (c.updated_at = $1 AND c.id < $2)) \
             ORDER BY c.updated_at DESC, c.id DESC LIMIT $3"
        ))
        .bind(before_at)
        .bind(before_id)
        .bind((limit + 1) as i64)
        .fetch_all(&self.pool)
        .await?;
        into_page(rows, limit)
    }

    /// Bytes of text `owner` keeps stored: every message's content, reasoning and raw text.
    pub async fn stored_text_bytes(&self, owner: &str) -> Result<u64, StoreError> {
        let query = match self.backend {
            Backend::Sqlite => {
                "SELECT CAST(COALESCE(SUM(length(CAST(m.content AS BLOB)) \
                   + COALESCE(length(CAST(m.reasoning AS BLOB)), 0) \
                   + COALESCE(length(CAST(m.raw AS BLOB)), 0)), 0) AS BIGINT) \
                 FROM messages m JOIN conversations c ON c.id = m.conversation_id \
                 WHERE c.owner = $1"
            }
            Backend::Postgres => {
                "SELECT CAST(COALESCE(SUM(octet_length(m.content) \
                   + COALESCE(octet_length(m.reasoning), 0) \
                   + COALESCE(octet_length(m.raw), 0)), 0) AS BIGINT) \
                 FROM messages m JOIN conversations c ON c.id = m.conversation_id \
                 WHERE c.owner = $1"
            }
        };
        let n: i64 = sqlx::query_scalar(query)
            .bind(owner)
            .fetch_one(&self.pool)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// How many conversations `owner` has stored.
    pub async fn count_conversations(&self, owner: &str) -> Result<i64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM conversations WHERE owner = $1")
            .bind(owner)
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// Stores an imported conversation for `owner` in one transaction: a new conversation (new
    /// id, created now) with `title` and `settings`, and `messages` in their order with new ids
    /// and everything else as given. Nothing is stored if any row fails. The caller has
    /// validated the content; a `streaming` message is refused here (no reply is running for
    /// it).
    pub async fn import_conversation(
        &self,
        owner: &str,
        title: &str,
        settings: &ConversationSettings,
        messages: &[ImportedMessage],
    ) -> Result<Conversation, StoreError> {
        let rows = StoredRow::linear(messages.len(), |_| true);
        self.insert_conversation(Uuid::now_v7(), owner, title, settings, messages, &rows)
            .await
    }

    /// Stores a whole conversation under `id` in one transaction, as
    /// [`Store::import_conversation`] does, with each message's id, `imported` flag (`false`: the
    /// model wrote it) and parent given in `rows`; the conversation shows the branch of the
    /// last row that is a leaf of it ([`StoredRow::current`]), else of the last message. The
    /// Responses API stores each response this way, an export of version 2 imports this way.
    pub async fn insert_conversation(
        &self,
        id: Uuid,
        owner: &str,
        title: &str,
        settings: &ConversationSettings,
        messages: &[ImportedMessage],
        rows: &[StoredRow],
    ) -> Result<Conversation, StoreError> {
        if rows.len() != messages.len() {
            return Err(StoreError::RowsMismatch {
                messages: messages.len(),
                rows: rows.len(),
            });
        }
        if let Some((i, _)) = rows
            .iter()
            .enumerate()
            .find(|(i, r)| r.parent.is_some_and(|p| p >= *i))
        {
            return Err(StoreError::BadTree(format!(
                "message {i} follows a message that is not before it"
            )));
        }
        settings.validate().map_err(StoreError::InvalidSettings)?;
        if messages
            .iter()
            .any(|m| m.status == MessageStatus::Streaming)
        {
            return Err(StoreError::InvalidStatus(MessageStatus::Streaming.as_str()));
        }
        let settings_json = encode_json("settings", settings)?;
        let now = now_micros();
        let mut tx = WriteTx::begin(self).await?;
        let row: ConversationRow = sqlx::query_as(concat!(
            "INSERT INTO conversations (id, owner, title, settings, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $5) RETURNING ",
            conversation_columns!()
        ))
        .bind(id.to_string())
        .bind(owner)
        .bind(title)
        .bind(settings_json)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        for (i, m) in messages.iter().enumerate() {
            let timings = m
                .timings
                .as_ref()
                .map(|t| encode_json("timings", &t.sanitized()))
                .transpose()?;
            sqlx::query(
                "INSERT INTO messages (id, conversation_id, position, role, content, reasoning, \
                 raw, status, error, prompt_tokens, completion_tokens, cached_tokens, timings, \
                 created_at, imported, parent_id) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
            )
            .bind(rows[i].id.to_string())
            .bind(id.to_string())
            .bind(i as i64 + 1)
            .bind(m.role.as_str())
            .bind(&m.content)
            .bind(m.reasoning.as_deref())
            .bind(m.raw.as_deref())
            .bind(m.status.as_str())
            .bind(m.error.as_deref())
            .bind(m.prompt_tokens)
            .bind(m.completion_tokens)
            .bind(m.cached_tokens)
            .bind(timings)
            .bind(m.created_at.timestamp_micros())
            .bind(i64::from(rows[i].imported))
            .bind(rows[i].parent.map(|p| rows[p].id.to_string()))
            .execute(&mut *tx)
            .await?;
            for f in &m.files {
                sqlx::query(
                    "INSERT INTO files (id, conversation_id, message_id, owner, name, kind, \
                     media_type, size_bytes, text, tokens, created_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                )
                .bind(Uuid::now_v7().to_string())
                .bind(id.to_string())
                .bind(rows[i].id.to_string())
                .bind(owner)
                .bind(&f.name)
                .bind(&f.kind)
                .bind(&f.media_type)
                .bind(f.size_bytes)
                .bind(&f.text)
                .bind(f.tokens)
                .bind(m.created_at.timestamp_micros())
                .execute(&mut *tx)
                .await?;
            }
        }
        let leaf = rows
            .iter()
            .rposition(|r| r.current)
            .or_else(|| rows.len().checked_sub(1));
        if let Some(leaf) = leaf {
            set_leaf(&mut tx, id, rows[leaf].id).await?;
        }
        tx.commit().await?;
        let conversation = row.into_conversation()?;
        tracing::debug!(conversation = %conversation.id, owner, messages = messages.len(), "conversation stored whole");
        Ok(conversation)
    }

    /// Every conversation of every owner, most recently active first, page after page of
    /// [`Store::list_all_conversations_page`] (tools and tests).
    pub async fn list_all_conversations(&self) -> Result<Vec<ConversationSummary>, StoreError> {
        let mut all = Vec::new();
        let mut page = PageRequest {
            limit: MAX_PAGE,
            before: None,
        };
        loop {
            let got = self.list_all_conversations_page(&page).await?;
            all.extend(got.items);
            match got.next {
                Some(next) => page.before = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// Sets the title as given (the caller trims and limits it). `false` when there is no such
    /// conversation.
    pub async fn rename_conversation(&self, id: Uuid, title: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("UPDATE conversations SET title = $1, updated_at = $2 WHERE id = $3")
                .bind(title)
                .bind(now_micros())
                .bind(id.to_string())
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Sets the title only if the conversation has none (a title written for it must not
    /// replace one its owner set meanwhile), leaving `updated_at` as it is (a title is not
    /// activity). Whether it was set.
    pub async fn title_if_untitled(&self, id: Uuid, title: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("UPDATE conversations SET title = $1 WHERE id = $2 AND title = ''")
                .bind(title)
                .bind(id.to_string())
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Replaces the settings. `false` when there is no such conversation.
    pub async fn update_settings(
        &self,
        id: Uuid,
        settings: &ConversationSettings,
    ) -> Result<bool, StoreError> {
        settings.validate().map_err(StoreError::InvalidSettings)?;
        let settings_json = encode_json("settings", settings)?;
        let result =
            sqlx::query("UPDATE conversations SET settings = $1, updated_at = $2 WHERE id = $3")
                .bind(settings_json)
                .bind(now_micros())
                .bind(id.to_string())
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Deletes the conversation and (ON DELETE CASCADE) its messages. `false` when there is no
    /// such conversation.
    pub async fn delete_conversation(&self, id: Uuid) -> Result<bool, StoreError> {
        let result = sqlx::query("DELETE FROM conversations WHERE id = $1")
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        let deleted = result.rows_affected() > 0;
        if deleted {
            tracing::debug!(conversation = %id, "conversation deleted");
        }
        Ok(deleted)
    }
}
