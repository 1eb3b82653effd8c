//! Plain message types shared by the actors and their callers (the web layer, tests).

use std::time::Duration;

use serde::Serialize;
use tokio::sync::mpsc;
use uuid::Uuid;

use smolchat_engine::SeqId;
use smolchat_text::generation::FinishReason;
use smolchat_text::sampling::SamplingParams;

/// Identifies one generation request inside the scheduler and the model worker.
pub type RequestId = u64;

/// Which KV cache the model worker keeps a sequence under between requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CacheKey {
    /// A conversation's cache: kept after each turn for the next one to reuse.
    Conversation(Uuid),
    /// A stateless request's cache, kept (a bounded number of them) for later requests of the
    /// same partition, their `cache_salt`, to reuse; `seq` tells one partition's caches apart.
    Anonymous { partition: String, seq: SeqId },
}

impl CacheKey {
    /// The conversation, for a conversation's cache.
    pub fn conversation(&self) -> Option<Uuid> {
        match self {
            CacheKey::Conversation(id) => Some(*id),
            CacheKey::Anonymous { .. } => None,
        }
    }
}

impl std::fmt::Display for CacheKey {
    /// The conversation id, or `anonymous #N` (the partition is a tag of a client's identity
    /// and is never shown).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheKey::Conversation(id) => write!(f, "{id}"),
            CacheKey::Anonymous { seq, .. } => write!(f, "anonymous #{seq}"),
        }
    }
}

/// A request for one reply: the full prompt (the worker reuses whatever prefix of it is cached under
/// `cache_key`), how to sample, and where to send the tokens.
pub struct GenerationRequest {
    /// The conversation whose KV cache this sequence is kept under between requests. `None` for
    /// stateless requests, whose cache is kept only for reuse within their `cache_salt`.
    pub cache_key: Option<Uuid>,
    /// Who the work is for (an owner, an account, an API key; opaque), for fair sharing and
    /// per-user limits in the scheduler. `None`: anonymous (tools, tests), no per-user caps.
    pub user: Option<String>,
    /// A wider group the user belongs to with a token quota of its own (a guest's client
    /// address: guest owners cost nothing to mint, so each would otherwise be a fresh quota).
    pub group: Option<String>,
    /// The partition a stateless request's cache belongs to (an opaque tag of the client's
    /// identity, made by the web layer). A request without `cache_key` reuses only prefixes
    /// cached by requests with the same salt, so one client cannot learn from `cached_tokens`
    /// or the time to first token what another client's prompts held.
    pub cache_salt: Option<String>,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Wall-clock limit for the whole request (queueing included).
    pub max_time: Option<Duration>,
    /// Receives the request's events. Dropping the receiver cancels the request at the next step.
    pub events: mpsc::UnboundedSender<GenEvent>,
    /// `Some`: an embedding, not a reply. Every prompt position is computed afresh (no cache is
    /// reused or kept), the final hidden states are pooled and L2-normalized, and the request
    /// ends with [`GenEvent::Embedding`] then [`GenEvent::Finished`], generating nothing.
    pub embed: Option<Pooling>,
    /// A typed draft's prompt, computed into the conversation's cache (`cache_key`) and
    /// nothing generated: the request ends once its prompt is in (see [`crate::warm`]).
    pub warm: bool,
}

impl GenerationRequest {
    /// A reply to `prompt` for nobody in particular: no conversation, user, group or cache
    /// partition, no time limit (tools, benchmarks, tests; set what differs with `..`).
    pub fn anonymous(
        prompt: Vec<u32>,
        params: SamplingParams,
        events: mpsc::UnboundedSender<GenEvent>,
    ) -> Self {
        GenerationRequest {
            cache_key: None,
            user: None,
            group: None,
            cache_salt: None,
            prompt,
            params,
            max_time: None,
            events,
            embed: None,
            warm: false,
        }
    }
}

/// How an embedding pools the final hidden states of its positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The mean over every position.
    #[default]
    Mean,
    /// The last position's (it has attended to all the others).
    Last,
}

/// What happens to a request, in order: `Admitted` once, `Token` per generated token, `Finished`
/// exactly once (also after a cancellation or an error).
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// The request left the queue and its prompt is being prefilled.
    Admitted {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// One generated token and the text it completes (possibly empty), with its
    /// log-probabilities when the request asked for them.
    Token {
        token: u32,
        text: String,
        logprobs: Option<smolchat_text::sampling::TokenLogprobs>,
    },
    /// An embedding request's vector (pooled and L2-normalized), just before `Finished`.
    Embedding(Vec<f32>),
    Finished(GenSummary),
}

/// Why a request ended, as the platform sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum StopReason {
    /// End-of-generation token.
    EndOfGeneration,
    /// A stop string was produced.
    StopString(String),
    /// The new-token limit or the context window was reached.
    Length,
    /// Stopped by a user or because every listener went away.
    Cancelled,
    /// The request's wall-clock limit passed.
    TimeLimit,
    /// The request failed.
    Error(Failure),
}

/// Why a request failed, by whose fault: the web layer answers a [`Failure::Constraint`] or a
/// [`Failure::Request`] as the client's error and an [`Failure::Engine`] as the server's. Its
/// text (`Display`) is what a stored reply's error says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, thiserror::Error)]
#[serde(
    rename_all = "snake_case",
    tag = "kind",
    content = "message",
    from = "FailureWire"
)]
pub enum Failure {
    /// The reply could not follow the request's grammar.
    #[error("constraint: {0}")]
    Constraint(String),
    /// The request cannot be served as it was asked (its sampling parameters, a prompt the KV
    /// cache cannot hold).
    #[error("{0}")]
    Request(String),
    /// The engine, the device or the model thread failed.
    #[error("{0}")]
    Engine(String),
}

impl Failure {
    /// The failure a stored reply's error text records (see `Display`).
    pub fn from_stored(text: &str) -> Failure {
        match text.strip_prefix("constraint: ") {
            Some(rest) => Failure::Constraint(rest.to_string()),
            None => Failure::Engine(text.to_string()),
        }
    }
}

/// A [`Failure`] as it arrives from another replica: typed, or the plain text that replicas
/// from before it was typed send.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum FailureWire {
    Typed(TypedFailure),
    Text(String),
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "message")]
enum TypedFailure {
    Constraint(String),
    Request(String),
    Engine(String),
}

impl From<FailureWire> for Failure {
    fn from(w: FailureWire) -> Failure {
        match w {
            FailureWire::Typed(TypedFailure::Constraint(m)) => Failure::Constraint(m),
            FailureWire::Typed(TypedFailure::Request(m)) => Failure::Request(m),
            FailureWire::Typed(TypedFailure::Engine(m)) => Failure::Engine(m),
            FailureWire::Text(text) => Failure::from_stored(&text),
        }
    }
}

impl From<FinishReason> for StopReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::EndOfGeneration => StopReason::EndOfGeneration,
            FinishReason::StopString(s) => StopReason::StopString(s),
            FinishReason::Length => StopReason::Length,
        }
    }
}

/// Counts and timings of a finished request.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct GenSummary {
    pub reason: StopReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the cache (not recomputed).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// From submission to the first generated token.
    pub ttft_ms: f64,
    /// From the first generated token to the end.
    pub generation_ms: f64,
    /// Speculative decoding in this request: draft tokens verified, and those the model
    /// confirmed (absent from replicas that predate them).
    #[serde(default)]
    pub drafted_tokens: u64,
    #[serde(default)]
    pub accepted_tokens: u64,
    /// Of `cached_tokens`, those read back from the KV spill tier (disk or host memory) for
    /// this request; the rest were on the device already.
    #[serde(default)]
    pub restored_tokens: usize,
    /// Of `cached_tokens`, those computed while the user typed the message (see
    /// [`crate::warm`]).
    #[serde(default)]
    pub warmed_tokens: usize,
}

/// Why the model cannot take requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ModelUnavailable {
    /// The model worker's thread has ended (the server is stopping, or it failed).
    #[error("the model thread stopped")]
    ModelStopped,
    /// The model was unloaded (to make room for another, or by an admin) before the request
    /// reached it.
    #[error("the model was unloaded; send the request again to load it")]
    Unloaded,
    /// The scheduler actor did not take the request.
    #[error("the scheduler is not available ({0})")]
    Scheduler(actix::MailboxError),
}

/// Why the scheduler refused a request.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the server is busy ({queued} requests are waiting); retry in {retry_after_s} s")]
    Overloaded { queued: usize, retry_after_s: u64 },
    #[error("the prompt has {prompt_tokens} tokens but the context window is {window}; shorten the conversation or start a new one")]
    ContextOverflow { prompt_tokens: usize, window: usize },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("the model is not available: {0}")]
    Unavailable(ModelUnavailable),
    #[error("you already have {queued} requests waiting (the limit per user is {limit}); retry in {retry_after_s} s")]
    UserLimit {
        queued: usize,
        limit: usize,
        retry_after_s: u64,
    },
    #[error("you have used {used} tokens (prompt and generated) in the last minute (the limit per user is {limit}); retry in {retry_after_s} s")]
    TokenLimit {
        used: u64,
        limit: u64,
        retry_after_s: u64,
    },
    #[error("the prompt has {prompt_tokens} tokens but the KV cache holds {capacity_tokens} in all (scheduler.kv_budget_mib); shorten the conversation or start a new one")]
    ExceedsKvCache {
        prompt_tokens: usize,
        capacity_tokens: usize,
    },
    #[error("guests from your address have used {used} tokens in the last minute (the limit per address is {limit}); sign in, or retry in {retry_after_s} s")]
    GroupTokenLimit {
        used: u64,
        limit: u64,
        retry_after_s: u64,
    },
    /// A quota counted in the database across every replica (which one, and when it resets,
    /// is in the message).
    #[error("{message}")]
    Quota { message: String, retry_after_s: u64 },
}

/// What the GPU's memory holds and how decode graphs are used, as the scheduler reports them.
pub use smolchat_engine::device::DeviceMemory;
pub use smolchat_engine::fast::graph::GraphStats;

/// A snapshot of the scheduler for `/metrics`, `/admin` and tests.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SchedulerStats {
    pub queued: usize,
    pub running: usize,
    pub max_running: usize,
    pub queue_capacity: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    pub prefilled_tokens: u64,
    /// Prompt tokens served from caches instead of being recomputed.
    pub reused_tokens: u64,
    /// Generated tokens per second over the last few seconds.
    pub tokens_per_s: f64,
    pub kv_bytes: usize,
    pub kv_budget_bytes: usize,
    pub cached_sequences: usize,
    /// The KV spill tier, when it is on.
    pub spill: Option<SpillStats>,
    pub evictions: u64,
    pub last_step_ms: f64,
    /// What the GPU's memory holds, when the model is on one.
    pub device_memory: Option<DeviceMemory>,
    /// How decode graphs have been used, when the backend replays them.
    pub graphs: Option<GraphStats>,
    /// Speculative decoding since start: draft tokens verified and accepted, and the
    /// (sequence, step) pairs that verified drafts.
    pub drafted_tokens: u64,
    pub accepted_draft_tokens: u64,
    pub verifying_steps: u64,
    /// What a decode-only step costs as the model worker measures it (milliseconds): the fixed
    /// part and each position's, which set where drafts pay (0 before it measured one).
    pub step_fixed_ms: f64,
    pub step_position_ms: f64,
    /// The acceptance one conversation's draft position must reach to pay (0 before a step
    /// was measured).
    pub draft_break_even: f64,
    /// Typed drafts warmed in spare steps.
    pub warm: WarmStats,
}

/// What the admin page and `/metrics` show of typed drafts being warmed (see [`crate::warm`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WarmStats {
    /// Whether drafts are warmed at all (`scheduler.warm_drafts`).
    pub enabled: bool,
    /// Drafts waiting for a spare step.
    pub waiting: usize,
    /// Whether a draft is being computed now.
    pub warming: bool,
    /// Drafts offered since start (each replacing that user's previous one).
    pub offered: u64,
    /// Drafts started, and started ones whose prompt was computed to its end.
    pub started: u64,
    pub completed: u64,
    /// Drafts cancelled because a reply arrived (each keeps what it had computed and starts
    /// again at the next spare step, unless a send made it moot).
    pub interrupted: u64,
    /// Prompt tokens computed for drafts.
    pub tokens: u64,
    /// Prompt tokens of sent messages found in caches that drafts computed (the model
    /// worker's count; set by the scheduler).
    pub reused_tokens: u64,
}

/// What a cache key (a conversation) is doing right now, for the admin page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SequenceState {
    Idle,
    Queued,
    Prefilling,
    Generating,
    /// Its owner is typing: the draft's prompt is computed into the cache in spare steps.
    Warming,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure crosses replicas typed; one from a replica that sent plain text still reads,
    /// and a stored reply's error text reads back as the failure it was.
    #[test]
    fn failures_read_back_typed_and_from_text() {
        let failed = StopReason::Error(Failure::Constraint("no token fits".into()));
        let text = serde_json::to_string(&failed).unwrap_or_default();
        assert_eq!(
            serde_json::from_str::<StopReason>(&text).ok(),
            Some(failed.clone())
        );
        let old = r#"{"kind":"error","detail":"constraint: no token fits"}"#;
        assert_eq!(serde_json::from_str::<StopReason>(old).ok(), Some(failed));
        let old = r#"{"kind":"error","detail":"the engine step failed"}"#;
        assert_eq!(
            serde_json::from_str::<StopReason>(old).ok(),
            Some(StopReason::Error(Failure::Engine(
                "the engine step failed".into()
            )))
        );
        let request = Failure::Request("invalid sampling parameters".into());
        assert_eq!(request.to_string(), "invalid sampling parameters");
        assert_eq!(
            Failure::from_stored(&Failure::Constraint("x".into()).to_string()),
            Failure::Constraint("x".into())
        );
    }
}

/// The KV spill tier as the worker last reported it ([`crate::spill`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SpillStats {
    pub files: usize,
    pub bytes: u64,
    pub budget_bytes: u64,
    /// Bytes of snapshots also held in host memory.
    pub ram_bytes: usize,
    /// Caches written and read back since start.
    pub writes: u64,
    pub restores: u64,
    /// Conversations whose cache was neither on the device nor in the tier (new ones
    /// included), and files that could not be used (computed again instead).
    pub misses: u64,
    pub rejected: u64,
    /// Time spent restoring, in microseconds over `restores` (the mean restore time).
    pub restore_micros: u64,
}
