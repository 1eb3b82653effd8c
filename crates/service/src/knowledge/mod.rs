//! Knowledge (issue 53): collections of documents the chat can search. A document is read as
//! a conversation's files are (`crate::files`, a PDF in the sandboxed reader), kept whole, cut
//! into passages ([`chunk`]) and embedded by the embedding model in the background (at the
//! scheduler's background priority: never ahead of anyone's reply). Retrieval is hybrid: the
//! store's keyword index (FTS5 / PostgreSQL full text) and an exact cosine scan of the
//! collection's vectors, fused by reciprocal rank ([`retrieve`]).
//!
//! Who may do what, in one place: a collection is its owner's; an admin may share it with
//! everyone or with chosen accounts, who may then search and read it (not change it). Another
//! user's collection that is not shared with the caller is "not found", whatever the request.
//! Documents count in the owner's stored bytes (`limits.max_stored_mib_per_user`).

pub mod chunk;
pub mod retrieve;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use smolchat_store::{Chunk, Collection, Document, DocumentStatus, NewDocument, Store};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::audit::Audit;
use crate::completions::{EmbeddingRequest, Pooling};
use crate::config::KnowledgeConfig;
pub use crate::config::{EmbeddingPooling, PROMPT_EOL};
use crate::documents::{DocumentReader, ReadError};
use crate::models::{Models, ServedModel};
use crate::Caller;
use chunk::ChunkShape;
use retrieve::VectorSet;

type Result<T, E = KnowledgeError> = std::result::Result<T, E>;

/// Why the knowledge service refused (the web layer maps each to one status code, through
/// `ConversationError`'s).
#[derive(Debug, thiserror::Error)]
pub enum KnowledgeError {
    /// No such collection or document (or not the caller's to see). 404.
    #[error("{0}")]
    NotFound(String),
    /// A field is wrong; the message names it. 400.
    #[error("{message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// Over a size or count limit. 413.
    #[error("{0}")]
    TooLarge(String),
    /// Not the caller's to change. 403.
    #[error("{0}")]
    Forbidden(String),
    /// The embedding model cannot answer now. 503.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(#[from] smolchat_store::StoreError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    /// A fault on our side. 500.
    #[error("{0}")]
    Internal(String),
}

/// How a search ranks passages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SearchMode {
    Keyword,
    Vector,
    /// Both, fused by reciprocal rank.
    #[default]
    Hybrid,
}

/// A passage a search found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Passage {
    #[serde(flatten)]
    pub chunk: Chunk,
    /// The fused score (reciprocal rank; for one mode alone, that mode's rank).
    pub score: f64,
    /// Its rank (from 1) in the keyword and the vector results, where it was in them.
    pub keyword_rank: Option<usize>,
    pub vector_rank: Option<usize>,
}

/// Candidates each ranking gives the fusion.
const CANDIDATES: usize = 50;
/// Chunks embedded per request to the model (one batch of the scheduler's).
const EMBED_BATCH: usize = 16;
/// Tokens of a passage the embedding reads at most.
const EMBED_MAX_TOKENS: usize = 1024;
/// Longest collection name and description, in characters.
const NAME_LIMIT: usize = 100;
const DESCRIPTION_LIMIT: usize = 1_000;
/// Longest search text, in characters.
const QUERY_LIMIT: usize = 2_000;
/// Collections one conversation may search.
pub const MAX_CHOSEN: usize = 10;

/// The passages a message was given, as the store records them (`[n]` from 1).
pub fn sources_of(passages: &[Passage]) -> Vec<smolchat_store::MessageSource> {
    passages
        .iter()
        .enumerate()
        .map(|(i, p)| smolchat_store::MessageSource {
            n: i as i64 + 1,
            collection_id: p.chunk.collection_id,
            document_id: p.chunk.document_id,
            document_name: p.chunk.document_name.clone(),
            heading: p.chunk.heading.clone(),
            text: p.chunk.text.trim().to_string(),
        })
        .collect()
}

/// How a turn reads the passages found for it: numbered sources before the user's message,
/// and how to cite them. The message's text follows unchanged.
pub fn with_passages(passages: &[Passage], message: &str) -> String {
    if passages.is_empty() {
        return message.to_string();
    }
    let mut out = String::from(
        "Sources found for this message (cite the ones you use as [1], [2], …; say so when \
         they do not answer it):\n\n",
    );
    for (i, p) in passages.iter().enumerate() {
        let place = if p.chunk.heading.is_empty() {
            p.chunk.document_name.clone()
        } else {
            format!("{} › {}", p.chunk.document_name, p.chunk.heading)
        };
        out.push_str(&format!("[{}] {place}\n{}\n\n", i + 1, p.chunk.text.trim()));
    }
    out.push_str("Message: ");
    out.push_str(message);
    out
}

/// The knowledge service (see the module docs).
pub struct Knowledge {
    store: Store,
    models: Arc<Models>,
    reader: Arc<DocumentReader>,
    cfg: KnowledgeConfig,
    /// `limits.max_stored_mib_per_user` in bytes (0: no limit).
    max_stored_bytes: u64,
    audit: Audit,
    /// Wakes the indexer when a document is added.
    wake: Arc<Notify>,
    /// Each collection's vectors, loaded at its first search; dropped when its chunks change.
    vectors: Mutex<HashMap<Uuid, Arc<VectorSet>>>,
}

fn not_found() -> KnowledgeError {
    KnowledgeError::NotFound("no such collection (or it is not shared with you)".into())
}

fn invalid(field: &'static str, message: impl Into<String>) -> KnowledgeError {
    KnowledgeError::Invalid {
        field,
        message: message.into(),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

impl Knowledge {
    pub fn new(
        store: Store,
        models: Arc<Models>,
        reader: Arc<DocumentReader>,
        cfg: KnowledgeConfig,
        max_stored_bytes: u64,
    ) -> Arc<Self> {
        Arc::new(Self {
            audit: Audit::new(store.clone()),
            store,
            models,
            reader,
            cfg,
            max_stored_bytes,
            wake: Arc::new(Notify::new()),
            vectors: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &KnowledgeConfig {
        &self.cfg
    }

    /// The collections the caller may search: its own and those shared with it.
    pub async fn collections(&self, caller: &Caller) -> Result<Vec<Collection>> {
        // "Shared with everyone" means every account: a guest (anyone with a browser) sees none.
        if caller.guest {
            return Ok(Vec::new());
        }
        Ok(self.store.collections_visible_to(&caller.owner).await?)
    }

    /// Every collection (admins: the command line's list).
    pub async fn all_collections(&self, caller: &Caller) -> Result<Vec<Collection>> {
        if !caller.admin {
            return Err(KnowledgeError::Forbidden(
                "only an admin lists every collection".into(),
            ));
        }
        Ok(self.store.all_collections().await?)
    }

    /// Collection `id` and its documents, if the caller may read it.
    pub async fn collection(
        &self,
        caller: &Caller,
        id: Uuid,
    ) -> Result<(Collection, Vec<Document>)> {
        let c = self.visible(caller, id).await?;
        let docs = self.store.documents_of(id).await?;
        Ok((c, docs))
    }

    /// Collection `id` if the caller may read it (404 otherwise, whoever's it is).
    async fn visible(&self, caller: &Caller, id: Uuid) -> Result<Collection> {
        match self.store.collection(id).await? {
            Some(c) if !caller.guest && (c.visible_to(&caller.owner) || caller.admin) => Ok(c),
            _ => Err(not_found()),
        }
    }

    /// Collection `id` if the caller may change it: its owner, or an admin.
    async fn changeable(&self, caller: &Caller, id: Uuid) -> Result<Collection> {
        let c = self.visible(caller, id).await?;
        if c.owner != caller.owner && !caller.admin {
            return Err(KnowledgeError::Forbidden(format!(
                "the collection {:?} is shared with you to search; only its owner or an admin \
                 may change it",
                c.name
            )));
        }
        Ok(c)
    }

    /// Makes a collection of the caller's.
    pub async fn create_collection(
        &self,
        caller: &Caller,
        name: &str,
        description: &str,
    ) -> Result<Collection> {
        if caller.guest {
            return Err(KnowledgeError::Forbidden(
                "collections are for accounts: sign in or sign up to keep documents".into(),
            ));
        }
        let name = name.trim();
        if name.is_empty() || name.chars().count() > NAME_LIMIT {
            return Err(invalid(
                "name",
                format!("a collection's name must be 1 to {NAME_LIMIT} characters"),
            ));
        }
        if description.chars().count() > DESCRIPTION_LIMIT {
            return Err(invalid(
                "description",
                format!("a description may be at most {DESCRIPTION_LIMIT} characters"),
            ));
        }
        let owned = self
            .store
            .collections_visible_to(&caller.owner)
            .await?
            .iter()
            .filter(|c| c.owner == caller.owner)
            .count();
        if owned >= self.cfg.max_collections_per_user {
            return Err(KnowledgeError::TooLarge(format!(
                "you have {owned} collections, the most one account may have \
                 (knowledge.max_collections_per_user): delete one first"
            )));
        }
        let c = self
            .store
            .create_collection(&caller.owner, name, description.trim())
            .await?;
        self.audit
            .record_by(
                caller,
                "knowledge.create",
                &format!("collection:{}", c.id),
                "",
            )
            .await;
        Ok(c)
    }

    /// The collection that holds a conversation's files too long to read whole: the caller's
    /// own, found by its description (`conversation:<id>`), made the first time.
    pub async fn files_collection(
        &self,
        caller: &Caller,
        conversation: &Uuid,
        title: &str,
    ) -> Result<Collection> {
        let marker = format!("conversation:{conversation}");
        if let Some(c) = self
            .collections(caller)
            .await?
            .into_iter()
            .find(|c| c.owner == caller.owner && c.description == marker)
        {
            return Ok(c);
        }
        let title = title.trim();
        let name: String = if title.is_empty() {
            "Files of a conversation".to_string()
        } else {
            format!("Files of {title}")
        }
        .chars()
        .take(NAME_LIMIT)
        .collect();
        self.create_collection(caller, &name, &marker).await
    }

    /// Deletes a collection with its documents, passages and vectors.
    pub async fn delete_collection(&self, caller: &Caller, id: Uuid) -> Result<()> {
        self.changeable(caller, id).await?;
        self.store.delete_collection(id).await?;
        self.forget_vectors(id);
        self.audit
            .record_by(caller, "knowledge.delete", &format!("collection:{id}"), "")
            .await;
        Ok(())
    }

    /// Shares collection `id` with everyone (`everyone`) and with the accounts named `with`
    /// (exactly those: an empty list unshares). Admins only.
    pub async fn share(
        &self,
        caller: &Caller,
        id: Uuid,
        everyone: bool,
        with: &[String],
    ) -> Result<Collection> {
        if !caller.admin {
            return Err(KnowledgeError::Forbidden(
                "only an admin shares collections".into(),
            ));
        }
        self.visible(caller, id).await?;
        let mut owners = Vec::with_capacity(with.len());
        for name in with {
            match self.store.user_by_name(name).await? {
                Some(u) => owners.push(u.id),
                None => {
                    return Err(invalid(
                        "with",
                        format!("there is no account named {name:?}"),
                    ))
                }
            }
        }
        self.store.share_collection(id, everyone, &owners).await?;
        self.audit
            .record_by(
                caller,
                "knowledge.share",
                &format!("collection:{id}"),
                &format!(
                    "everyone: {everyone}; accounts: {}",
                    if with.is_empty() {
                        "none".to_string()
                    } else {
                        with.join(", ")
                    }
                ),
            )
            .await;
        self.visible(caller, id).await
    }

    /// Adds document `name` (`bytes`) to collection `id`: checked and read as a conversation's
    /// files are, counted in the owner's stored bytes, then indexed in the background.
    pub async fn add_document(
        &self,
        caller: &Caller,
        id: Uuid,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<Document> {
        let c = self.changeable(caller, id).await?;
        let limit = self.max_document_bytes();
        let size = bytes.len();
        let extracted = match self
            .reader
            .read(&caller.owner, name, bytes, limit, usize::MAX / 8)
            .await
        {
            Ok(e) => e,
            Err(ReadError::DoesNotFit { at_least }) => {
                return Err(KnowledgeError::TooLarge(format!(
                    "{name:?} is at least {at_least} tokens of text, more than a document may hold"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        if extracted.text.trim().is_empty() {
            return Err(invalid(
                "file",
                format!("{name:?} has no text to search (a scanned PDF has only pictures)"),
            ));
        }
        self.check_quota(&c.owner, extracted.text.len() as u64)
            .await?;
        let doc = self
            .store
            .add_document(
                id,
                &c.owner,
                &NewDocument {
                    name: &crate::files::check_name(name)?,
                    kind: extracted.kind.as_str(),
                    size_bytes: size as i64,
                    text: &extracted.text,
                },
            )
            .await?;
        self.audit
            .record_by(
                caller,
                "knowledge.add",
                &format!("collection:{id}"),
                &format!("document {}: {} bytes", doc.id, size),
            )
            .await;
        self.wake.notify_one();
        Ok(doc)
    }

    /// The most bytes a document may have (`knowledge.max_document_mib`).
    pub fn max_document_bytes(&self) -> usize {
        (self.cfg.max_document_mib as usize).saturating_mul(1 << 20)
    }

    /// Refuses `adding` more bytes of text when the owner's conversations, files and documents
    /// would pass `limits.max_stored_mib_per_user`.
    async fn check_quota(&self, owner: &str, adding: u64) -> Result<()> {
        let max = self.max_stored_bytes;
        if max == 0 {
            return Ok(());
        }
        let kept = self.store.stored_text_bytes(owner).await?
            + self.store.stored_knowledge_bytes(owner).await?;
        if kept.saturating_add(adding) > max {
            return Err(KnowledgeError::TooLarge(format!(
                "you keep {} MiB of conversations and documents and this document adds {} MiB; \
                 the limit is {} MiB per user (limits.max_stored_mib_per_user): delete some first",
                mib(kept),
                mib(adding),
                mib(max)
            )));
        }
        Ok(())
    }

    /// Deletes document `doc` of collection `id`, its passages and their vectors.
    pub async fn delete_document(&self, caller: &Caller, id: Uuid, doc: Uuid) -> Result<()> {
        self.changeable(caller, id).await?;
        match self.store.document(doc).await? {
            Some(d) if d.collection_id == id => {}
            _ => return Err(KnowledgeError::NotFound("no such document".into())),
        }
        self.store.delete_document(doc).await?;
        self.forget_vectors(id);
        self.audit
            .record_by(
                caller,
                "knowledge.remove",
                &format!("collection:{id}"),
                &format!("document {doc}"),
            )
            .await;
        Ok(())
    }

    /// The passages of `collections` that best answer `query` (`k` of them, best first).
    pub async fn search(
        &self,
        caller: &Caller,
        collections: &[Uuid],
        query: &str,
        k: Option<usize>,
        mode: SearchMode,
    ) -> Result<Vec<Passage>> {
        if collections.is_empty() {
            return Err(invalid(
                "collections",
                "name at least one collection to search",
            ));
        }
        let query = query.trim();
        if query.is_empty() || query.chars().count() > QUERY_LIMIT {
            return Err(invalid(
                "query",
                format!("the search text must be 1 to {QUERY_LIMIT} characters"),
            ));
        }
        let k = k.unwrap_or(self.cfg.top_k);
        if !(1..=50).contains(&k) {
            return Err(invalid("k", "`k` must be between 1 and 50"));
        }
        for id in collections {
            self.visible(caller, *id).await?;
        }
        let keyword = if mode == SearchMode::Vector {
            Vec::new()
        } else {
            let words = smolchat_store::query_words(query);
            self.store
                .keyword_search(collections, &words, CANDIDATES)
                .await?
                .into_iter()
                .map(|(id, _)| id)
                .collect()
        };
        let vector = if mode == SearchMode::Keyword {
            Vec::new()
        } else {
            self.nearest(caller, collections, query, CANDIDATES).await?
        };
        let fused = retrieve::fuse(&[(&keyword, 1.0), (&vector, self.cfg.vector_weight)]);
        let top: Vec<(i64, f64)> = fused.into_iter().take(k).collect();
        let ids: Vec<i64> = top.iter().map(|t| t.0).collect();
        let chunks = self.store.chunks(&ids).await?;
        let rank = |list: &[i64], id: i64| list.iter().position(|x| *x == id).map(|r| r + 1);
        Ok(chunks
            .into_iter()
            .filter_map(|chunk| {
                let score = top.iter().find(|t| t.0 == chunk.id)?.1;
                Some(Passage {
                    keyword_rank: rank(&keyword, chunk.id),
                    vector_rank: rank(&vector, chunk.id),
                    score,
                    chunk,
                })
            })
            .collect())
    }

    /// The `n` passages of `collections` nearest `query`'s embedding, nearest first.
    async fn nearest(
        &self,
        caller: &Caller,
        collections: &[Uuid],
        query: &str,
        n: usize,
    ) -> Result<Vec<i64>> {
        let model = self.embedding_model().await?;
        let text = self.cfg.query_template.replace("{text}", query);
        let mut vectors = self
            .embed(&model, &[text], Some(caller.owner.clone()), false)
            .await?;
        let q = vectors.pop().unwrap_or_default();
        let mut found: Vec<(i64, f32)> = Vec::new();
        for id in collections {
            let set = self.vectors_of(*id).await?;
            found.extend(set.nearest(&q, n));
        }
        found.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        found.truncate(n);
        Ok(found.into_iter().map(|f| f.0).collect())
    }

    async fn vectors_of(&self, id: Uuid) -> Result<Arc<VectorSet>> {
        if let Some(set) = self.cached(id) {
            return Ok(set);
        }
        let rows = self.store.chunk_vectors(id).await?;
        let set = tokio::task::spawn_blocking(move || {
            VectorSet::new(
                rows.into_iter()
                    .filter_map(|(id, b)| smolchat_store::decode_vector(&b).map(|v| (id, v))),
            )
        })
        .await
        .map_err(|e| KnowledgeError::Internal(format!("the vector task failed: {e}")))?;
        let set = Arc::new(set);
        if let Ok(mut cache) = self.vectors.lock() {
            cache.insert(id, Arc::clone(&set));
        }
        Ok(set)
    }

    fn cached(&self, id: Uuid) -> Option<Arc<VectorSet>> {
        self.vectors.lock().ok()?.get(&id).cloned()
    }

    fn forget_vectors(&self, id: Uuid) {
        if let Ok(mut cache) = self.vectors.lock() {
            cache.remove(&id);
        }
    }

    /// The model that embeds documents and queries (loaded when it is not).
    async fn embedding_model(&self) -> Result<Arc<ServedModel>> {
        self.models
            .resolve(&self.cfg.embedding_model)
            .await
            .map_err(|e| match e {
                // A name that is not served will not become one by waiting: documents fail,
                // saying which setting to fix, instead of the indexer trying again for ever.
                e @ (crate::models::ModelError::NotFound { .. }
                | crate::models::ModelError::Load { .. }) => {
                    KnowledgeError::Internal(format!("knowledge.embedding_model: {e}"))
                }
                e => KnowledgeError::Unavailable(format!("the embedding model: {e}")),
            })
    }

    /// One vector per text (mean-pooled, as `/v1/embeddings` gives them), each text read as
    /// plain text (a control token in a document is ordinary tokens) and cut to
    /// [`EMBED_MAX_TOKENS`]; `background`: at the scheduler's background priority.
    async fn embed(
        &self,
        model: &Arc<ServedModel>,
        texts: &[String],
        user: Option<String>,
        background: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let tokenizer = model.tokenizer();
        let mut inputs = Vec::with_capacity(texts.len());
        for t in texts {
            let mut ids = Vec::new();
            if tokenizer.add_bos() {
                ids.extend(tokenizer.bos_id());
            }
            ids.extend(
                tokenizer
                    .encode(t, false)
                    .map_err(|e| KnowledgeError::Internal(format!("tokenizer: {e}")))?,
            );
            ids.truncate(EMBED_MAX_TOKENS);
            inputs.push(ids);
        }
        let embedded = model
            .completions()
            .embed(EmbeddingRequest {
                inputs,
                pooling: match self.cfg.embedding_pooling {
                    EmbeddingPooling::Mean => Pooling::Mean,
                    EmbeddingPooling::Last => Pooling::Last,
                },
                user,
                cache_salt: "knowledge".into(),
                usage_owner: None,
                background,
            })
            .await
            .map_err(|e| KnowledgeError::Unavailable(format!("embedding: {e}")))?;
        Ok(embedded.vectors)
    }

    /// Starts the indexer: documents not indexed yet (added, or cut off by a crash) are
    /// chunked and embedded one after another, in the background.
    pub fn start(self: &Arc<Self>) {
        let me = Arc::clone(self);
        actix::spawn(async move {
            loop {
                let pending = match me.store.documents_to_index().await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!("knowledge: cannot list documents to index: {e}");
                        Vec::new()
                    }
                };
                for doc in &pending {
                    me.index(doc).await;
                }
                if pending.is_empty() {
                    // Woken by a new document, or a look every minute (another replica's).
                    let _ = tokio::time::timeout(Duration::from_secs(60), me.wake.notified()).await;
                }
            }
        });
    }

    /// Indexes one document to its end: chunks (once), then embeddings in batches; a failure
    /// the model may get over (a full server) is tried again later, others mark it failed.
    async fn index(&self, doc: &Document) {
        match self.index_inner(doc).await {
            Ok(()) => {
                if let Err(e) = self.store.finish_document(doc.id, None).await {
                    tracing::warn!(document = %doc.id, "knowledge: cannot mark a document ready: {e}");
                }
                tracing::info!(document = %doc.id, chunks = doc.chunks, "knowledge: document indexed");
            }
            Err(e @ KnowledgeError::Unavailable(_)) => {
                tracing::info!(document = %doc.id, "knowledge: indexing waits ({e})");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            Err(KnowledgeError::Store(e)) if e.is_unavailable() => {
                tracing::info!(document = %doc.id, "knowledge: indexing waits ({e})");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            Err(e) => {
                let why = e.to_string();
                tracing::warn!(document = %doc.id, "knowledge: indexing failed: {why}");
                if let Err(e) = self.store.finish_document(doc.id, Some(&why)).await {
                    tracing::warn!(document = %doc.id, "knowledge: cannot mark a document failed: {e}");
                }
            }
        }
        self.forget_vectors(doc.collection_id);
    }

    async fn index_inner(&self, doc: &Document) -> Result<()> {
        let model = self.embedding_model().await?;
        if doc.status == DocumentStatus::Pending || doc.chunks == 0 {
            let Some(text) = self.store.document_text(doc.id).await? else {
                return Ok(());
            };
            let shape = ChunkShape {
                max_tokens: self.cfg.chunk_tokens,
                overlap_tokens: self.cfg.chunk_overlap_tokens,
            };
            let m = Arc::clone(&model);
            let chunks = tokio::task::spawn_blocking(move || {
                let count = |t: &str| {
                    m.tokenizer()
                        .encode(t, false)
                        .map_or(t.len() / 4, |v| v.len())
                };
                chunk::chunk(&text, shape, &count)
            })
            .await
            .map_err(|e| KnowledgeError::Internal(format!("the chunking task failed: {e}")))?;
            if !self
                .store
                .set_document_chunks(doc.id, doc.collection_id, &chunks)
                .await?
            {
                return Ok(());
            }
        }
        loop {
            let batch = self.store.chunks_to_embed(doc.id, EMBED_BATCH).await?;
            if batch.is_empty() {
                return Ok(());
            }
            let texts: Vec<String> = batch
                .iter()
                .map(|(_, heading, text)| {
                    let passage = if heading.is_empty() {
                        text.clone()
                    } else {
                        format!("{heading}\n\n{text}")
                    };
                    self.cfg.document_template.replace("{text}", &passage)
                })
                .collect();
            let vectors = self
                .embed(
                    &model,
                    &texts,
                    Some(format!("knowledge:{}", doc.owner)),
                    true,
                )
                .await?;
            let rows: Vec<(i64, Vec<f32>)> =
                batch.iter().map(|(id, _, _)| *id).zip(vectors).collect();
            self.store.set_chunk_embeddings(doc.id, &rows).await?;
        }
    }

    /// Checks a conversation's choice of collections: at most [`MAX_CHOSEN`], each one the
    /// caller may search. The error names what to change.
    pub async fn check_chosen(&self, caller: &Caller, ids: &[Uuid]) -> Result<()> {
        if ids.len() > MAX_CHOSEN {
            return Err(invalid(
                "knowledge",
                format!("a conversation searches at most {MAX_CHOSEN} collections"),
            ));
        }
        if caller.guest && !ids.is_empty() {
            return Err(invalid(
                "knowledge",
                "collections are for accounts: sign in or sign up to search them",
            ));
        }
        let visible = self.store.collections_visible_to(&caller.owner).await?;
        if let Some(missing) = ids.iter().find(|id| !visible.iter().any(|c| c.id == **id)) {
            return Err(invalid(
                "knowledge",
                format!(
                    "{missing} is not a collection you may search; yours are: {}",
                    if visible.is_empty() {
                        "none (make one on the knowledge page or with POST /api/knowledge)"
                            .to_string()
                    } else {
                        visible
                            .iter()
                            .map(|c| format!("{} ({})", c.name, c.id))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            ));
        }
        Ok(())
    }

    /// The passages a turn of `owner`'s conversation is given for `text`: the best of the
    /// chosen collections it may still search (one unshared since is skipped).
    pub async fn passages_for_turn(
        &self,
        owner: &str,
        chosen: &[Uuid],
        text: &str,
    ) -> Result<Vec<Passage>> {
        let caller = Caller {
            owner: owner.to_string(),
            admin: false,
            guest: false,
            address: None,
        };
        let visible = self.store.collections_visible_to(owner).await?;
        let ids: Vec<Uuid> = chosen
            .iter()
            .copied()
            .filter(|id| visible.iter().any(|c| c.id == *id))
            .collect();
        let text: String = text.chars().take(QUERY_LIMIT).collect();
        if ids.is_empty() || text.trim().is_empty() {
            return Ok(Vec::new());
        }
        self.search(&caller, &ids, &text, None, SearchMode::Hybrid)
            .await
    }
}
